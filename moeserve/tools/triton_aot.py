"""Ahead-of-time Triton kernels: ``moeserve precompile`` compiles, on a machine without a GPU, every Triton kernel
the configuration will launch into ``<kernel cache>/triton``, under exactly the cache keys the GPU machine's
Triton computes at launch (the engine then points Triton there: ``moeserve.kernel_cache.triton_cache``).

How: the real MoE layer of the model (router, routing kernel, fused MoE, combine, FP8 activation quantisation)
runs on ``meta`` tensors for every step size the engine can launch (1 to max_num_batched_tokens tokens), the
attention's QKV kernel (norms, rotary embedding, KV append) once, and the GEMV of the ``triton`` linear backend
for each of the model's linears and each step it takes, with a stand-in driver that reports the target GPU and
every ``kernel[grid](...)`` turned into a compile. So the launch signatures (argument dtypes, 16-byte alignment
of pointers, integer specialisations, tile configs from the tuned tables, constexprs) are the ones the engine
produces, without restating them here.

Two facts of Triton 3.6.0 shape this (read from its source, checked on an H200):
- A cache key includes a hash of the triton build, which hashes the binary ``_C/libtriton.so``; that file
  differs between the wheels for different Python versions, so the key is computed for the target's Python
  (``LIBTRITON_SHA256``; recompute an entry with ``sha256sum triton/_C/libtriton.so`` from that wheel).
- A key includes each kernel's source and its line number: an edit to a kernel file invalidates its entries
  (the manifest records a digest of the sources; the engine checks it at start).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from moeserve.kernel_cache.triton_cache import LAUNCHERS, MANIFEST, MANIFEST_FORMAT, TRITON_DIR

# sha256 of triton/_C/libtriton.so in PyPI's manylinux x86_64 wheels, by (triton version, Python tag)
LIBTRITON_SHA256 = {
    ("3.6.0", "cp312"): "28daaa70a904e4f8add754e518533e8a69b94ab8b16431ce77d45f1f25282b87",
}
DEFAULT_DEVICE_NAMES = {(9, 0): "NVIDIA_H200"}  # whose tuned MoE tables a 9.0a build uses by default


def python_tag(version: str | None = None) -> str:
    if version is None:
        return f"cp{sys.version_info.major}{sys.version_info.minor}"
    major, minor = version.split(".")[:2]
    return f"cp{major}{minor}"


def target_triton_key(target_python: str | None) -> tuple[str, str]:
    """``(triton_key, python tag)`` as the target machine's Triton (same version, ``target_python``) computes
    its key."""
    import triton
    from triton.runtime.cache import triton_key
    tag = python_tag(target_python)
    ours = triton_key()
    if tag == python_tag():
        return ours, tag
    lib_sha = LIBTRITON_SHA256.get((triton.__version__, tag))
    if lib_sha is None:
        known = ", ".join(f"triton {v} {t}" for v, t in LIBTRITON_SHA256) or "none"
        raise ValueError(f"--target-python {target_python}: no libtriton hash for triton {triton.__version__} "
                         f"{tag} (known: {known}); build on a machine with Python {target_python}, or add the sha256 of "
                         f"that wheel's triton/_C/libtriton.so to moeserve.tools.triton_aot.LIBTRITON_SHA256")
    mine = hashlib.sha256((Path(triton.__file__).parent / "_C" / "libtriton.so").read_bytes()).hexdigest()
    if mine not in ours:
        raise RuntimeError("triton_key() does not hash _C/libtriton.so as expected by this triton version")
    return ours.replace(mine, lib_sha), tag


class _CompileOnlyDriver:
    """Stands in for ``triton.runtime.driver.active`` on a machine without a GPU: reports the target; nothing
    launches (every launch is a compile-only warm-up)."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        raise RuntimeError("no GPU here: Triton kernels are compiled, not launched")


def _forget_bindings() -> None:
    """Every JIT function forgets its per-device binder and in-memory kernels (built for another target)."""
    import gc

    from triton.runtime.jit import JITFunction
    for obj in gc.get_objects():
        if type(obj) is JITFunction:
            obj.device_caches.clear()


def _listing_launch(self, grid):
    """A launch that records the kernel and its specialisation (what decides its cache entry) and compiles
    nothing: ``precompile --dry-run``."""
    from triton import knobs
    from triton.runtime.jit import MockTensor

    def call(*args, **kwargs):
        kw = dict(kwargs, debug=kwargs.get("debug", self.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
        binder = self.device_caches[0][-1]
        _, specialization, options = binder(*map(MockTensor.wrap_dtype, args), **kw)
        consts = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        _LISTED.setdefault((self.__name__, str(specialization), str(sorted(options.items()))),
                           {"name": self.__name__, "constants": {k: str(v) for k, v in consts.items()},
                            "num_warps": options.get("num_warps"), "num_stages": options.get("num_stages")})
    return call


_LISTED: dict = {}


def launcher_source(src, metadata: dict) -> str | None:
    """The C source of the launcher module Triton builds for this kernel at its first load (what
    ``triton.backends.nvidia.driver.CudaLauncher`` generates from the same source and metadata); None when this
    Triton has no such generator."""
    try:
        from triton.backends.nvidia.driver import make_launcher
    except ImportError:
        return None
    constants = getattr(src, "constants", {})
    arg_idx = lambda x: (src.fn.arg_names.index(x), ) if isinstance(x, str) else x  # noqa: E731 - as Triton
    constants = {arg_idx(idx): value for idx, value in constants.items()}
    signature = dict(src.signature.items())
    return make_launcher(constants, signature, metadata.get("tensordesc_meta"))


@contextlib.contextmanager
def compile_session(cache_dir: Path, capability: tuple[int, int], triton_key: str, dry_run: bool = False,
                    binary_only: bool = True):
    """Inside: Triton compiles for ``capability`` into ``cache_dir`` under ``triton_key``, and every kernel
    launch only compiles (with ``dry_run``, only records itself in ``_LISTED``). Yields the list of compile
    events (name, hash, cache_hit, constants, launcher source, and the launch's signature and specialization).
    ``binary_only``: the cache keeps what a launch reads (not the intermediate IR and PTX)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime import cache as tcache
    from triton.runtime.driver import driver
    from triton.runtime.jit import KernelInterface

    events: list[dict] = []

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        events.append({"name": getattr(src, "name", "?"), "hash": metadata["hash"], "cache_hit": cache_hit,
                       "constants": {str(k): str(v) for k, v in getattr(src, "constants", {}).items()},
                       "launcher": launcher_source(src, metadata),
                       "signature": {str(k): str(v) for k, v in getattr(src, "signature", {}).items()},
                       "attrs": str(getattr(src, "attrs", ""))})

    saved = (tcache.triton_key, driver._active, knobs.compilation.store_binary_only, knobs.compilation.listener,
             KernelInterface.__getitem__)
    cache_dir.mkdir(parents=True, exist_ok=True)
    knobs.cache.dir = str(cache_dir)
    knobs.compilation.store_binary_only = binary_only  # .cubin/.json and the group file: what a launch reads
    knobs.compilation.listener = listener
    driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", capability[0] * 10 + capability[1], 32)))
    tcache.triton_key = lambda: triton_key
    KernelInterface.__getitem__ = _listing_launch if dry_run else (
        lambda self, grid: (lambda *a, **kw: self.run(*a, grid=grid, warmup=True, **kw)))
    _LISTED.clear()
    _forget_bindings()
    try:
        yield events
    finally:
        (tcache.triton_key, driver._active, knobs.compilation.store_binary_only, knobs.compilation.listener,
         KernelInterface.__getitem__) = saved
        del knobs.cache.dir
        _forget_bindings()


@contextlib.contextmanager
def tuned_tables_for(device_name: str):
    """The MoE kernels pick their tuned configs by GPU name; read the target's tables on this machine."""
    from moeserve.ops.moe import fp8_triton, triton_configs
    saved = (triton_configs.device_name, fp8_triton.device_name)
    triton_configs.device_name = fp8_triton.device_name = lambda: device_name

    def clear():
        for f in (triton_configs.load_configs, triton_configs._get_config, fp8_triton.load_fp8_configs):
            f.cache_clear()
    clear()
    try:
        yield
    finally:
        triton_configs.device_name, fp8_triton.device_name = saved
        clear()


def _meta_ops(plan, moe, parallel, device: torch.device | None = None):
    """The torch reference operators on ``meta`` (or ``device``; the linears run through the torch backend)
    with ``moe``; ``parallel``: the rank whose shapes the model takes."""
    from moeserve.models.layers import Ops
    from moeserve.ops.basic import TorchActivation, TorchNorm, TorchRope
    from moeserve.ops.linear import TorchLinear
    return Ops(linear=TorchLinear(device or torch.device("meta"), plan.dtype), norm=TorchNorm(),
               activation=TorchActivation(), moe=moe, rope_cls=TorchRope, quantization=plan.quantization,
               parallel=parallel)


def _rank_without_group(parallel):
    """The plan's first rank (``moeserve.ops.parallel.Parallel``), its collectives turned into shape-keeping
    no-ops: a layer built on it holds a rank's split and runs on ``meta`` tensors without a process group. One
    rank: ``parallel`` itself."""
    import dataclasses

    from moeserve.ops.parallel import Parallel
    if not parallel.is_parallel:
        return parallel

    class NoGroup(Parallel):
        def all_reduce(self, x):
            return x

        def all_gather(self, x, dim=-1):
            shape = list(x.shape)
            shape[dim % x.dim()] *= self.tp_size
            return x.new_empty(shape)

        def reduce_scatter(self, x):
            return x.new_empty((x.shape[0] // self.tp_size, *x.shape[1:]))

    return NoGroup(**{f.name: getattr(parallel, f.name) for f in dataclasses.fields(Parallel)})


def meta_moe_layer(plan, device: torch.device | None = None):
    """The model's MoE layer on ``meta`` (or ``device``, its weights uninitialised) with the plan's Triton paths
    (MoE and routing kernels), built as the plan's first rank: with tensor parallelism its experts are a rank's
    slice of the intermediate size (with expert parallelism its share of the experts), and its collectives keep
    their shapes and move nothing."""
    from moeserve.models.layers import SparseMoE
    from moeserve.ops.moe.routing_triton import TritonTopkRouter
    from moeserve.ops.moe.torch_ref import TorchMoE
    from moeserve.ops.moe.triton_backend import TritonMoE
    fp = plan.triton_fingerprint("?")
    meta, dtype = device or torch.device("meta"), plan.dtype
    moe = TritonMoE(meta, dtype) if fp["moe"] else TorchMoE(meta, dtype)
    if fp["moe"]:
        moe.pairwise_max_tokens = fp["moe_pairwise_max_tokens"]
    ops = _meta_ops(plan, moe, _rank_without_group(plan.parallel), meta)
    ops.moe_fuse_norm_max_tokens = fp.get("fuse_norm_max_tokens", 0) if fp["fuse_norm"] else 0
    ops.moe_fuse_norm_in_grid = fp.get("fuse_norm_in_grid", False)
    ops.router_fuse_norm = fp["router_fuse_norm"]
    ops.moe_fused_shared_early = fp.get("fused_shared_early", False)
    ops.moe_route_in_grid = fp.get("route_in_grid", False)
    layer = SparseMoE(ops, plan.arch, dtype, meta)
    if fp["fuse_shared_expert"]:
        layer.fuse_shared_expert(fp.get("fuse_shared_expert_pieces", 0), fp.get("fuse_shared_expert_max_tokens", 0))
    if fp["routing"]:
        layer.router = TritonTopkRouter(plan.arch.routing, fp["router_split_k_max_tokens"])
        layer.routing_impl = TritonTopkRouter.name
    moe.prepare(layer)
    return layer


def meta_linear_shapes(plan, fp: dict) -> list[tuple[int, int, bool, torch.dtype]]:
    """``(N, K, bias, dtype)`` of every distinct linear of the model (built on ``meta``) that runs through the
    linear backend, the LM head among them; ``fp``: the plan's Triton fingerprint (whether the shared expert is
    fused, and how much)."""
    from moeserve.models.base import Linear
    from moeserve.models.layers import MoECausalLM
    from moeserve.ops.moe.torch_ref import TorchMoE
    meta, dtype = torch.device("meta"), plan.dtype
    shapes = set()
    # built as the plan's first rank: with tensor parallelism each rank's linears are its split (an output
    # projection of K / tp columns, an LM head of its vocabulary rows), and every rank's split has the same shape
    model = MoECausalLM(plan.arch, _meta_ops(plan, TorchMoE(meta, dtype), plan.parallel), dtype, meta)
    if fp["fuse_shared_expert"]:  # the shared expert's rows that stay apart are a linear of their own shape
        for block in model.moe_blocks():
            block.fuse_shared_expert(fp.get("fuse_shared_expert_pieces", 0),
                                     fp.get("fuse_shared_expert_max_tokens", 0))
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.weight_scale_inv is None:
            n, k = mod.weight.shape
            shapes.add((n, k, mod.bias is not None, mod.weight.dtype))
    shapes.add((*model.lm_head.shape, False, model.lm_head.dtype))  # compute_logits: the rank's vocabulary rows
    return sorted(shapes, key=str)


def launch_qkv_kernel(plan, tokens: int = 1) -> torch.Tensor:
    """The attention's QKV kernel (``moeserve.ops.attention.qkv_triton``) as the engine launches it for this plan,
    on ``meta`` tensors, for a step of ``tokens`` tokens (the grid; and whether it launches with PDL)."""
    from moeserve.models.parallel import local_heads
    from moeserve.ops.attention.qkv_triton import qkv_rope_append
    m, dev, dt = plan.arch, torch.device("meta"), plan.dtype
    hq, hkv, _ = local_heads(m, plan.parallel)
    d, i32 = m.head_dim, dict(dtype=torch.int32, device=dev)
    page = plan.config.page_size
    norm = (torch.ones(d, dtype=dt, device=dev), torch.ones(d, dtype=dt, device=dev)) if m.qk_norm else (None, None)
    return qkv_rope_append(
        torch.zeros((tokens, (hq + 2 * hkv) * d), dtype=dt, device=dev), torch.zeros(tokens, **i32),
        torch.zeros((8, m.rotary_dim), dtype=torch.float32, device=dev), hq, hkv, d,
        torch.zeros((2, 2, page, hkv, d), dtype=plan.kv_dtype, device=dev), torch.zeros(tokens, **i32),
        torch.zeros(tokens, **i32), torch.ones(1, **i32), torch.zeros(tokens + 1, **i32), *norm,
        eps=m.rms_norm_eps)


def launch_decode_kernel(plan, tokens: int = 1) -> torch.Tensor:
    """The one-kernel decode attention (``moeserve.ops.attention.decode_triton``) as the engine launches it for
    this plan, on ``meta`` tensors, for a decode step of ``tokens`` tokens (the split count is an argument the
    kernel is not specialised on: one compile serves every step size, with PDL or without)."""
    from moeserve.models.parallel import local_heads
    from moeserve.ops.attention.decode_triton import DecodeWorkspace, qkv_decode_attention
    m, dev, dt = plan.arch, torch.device("meta"), plan.dtype
    hq, hkv, _ = local_heads(m, plan.parallel)
    d, i32 = m.head_dim, dict(dtype=torch.int32, device=dev)
    norm = (torch.ones(d, dtype=dt, device=dev), torch.ones(d, dtype=dt, device=dev)) if m.qk_norm else (None, None)
    ws = DecodeWorkspace(tokens, hq, hkv, d, dev, num_sms=132)
    return qkv_decode_attention(
        torch.zeros((tokens, (hq + 2 * hkv) * d), dtype=dt, device=dev), torch.zeros(tokens, **i32),
        torch.zeros((8, m.rotary_dim), dtype=torch.float32, device=dev), hq, hkv, d,
        torch.zeros((2, 2, plan.config.page_size, hkv, d), dtype=plan.kv_dtype, device=dev),
        torch.zeros(tokens, **i32), torch.ones(1, **i32), torch.zeros(tokens + 1, **i32), *norm, eps=m.rms_norm_eps,
        scale=d ** -0.5, workspace=ws)


def launch_qkv_gemv_kernel(plan) -> torch.Tensor:
    """The QKV GEMV and the decode attention in one grid (``moeserve.ops.attention.qkv_gemv_triton``, with its
    ``QKV_IN_GRID``) as the engine launches it for this plan's one-token steps, on ``meta`` tensors."""
    from moeserve.models.parallel import local_heads
    from moeserve.ops.attention.decode_triton import DecodeWorkspace
    from moeserve.ops.attention.qkv_gemv_triton import qkv_gemv_decode_attention
    m, dev, dt = plan.arch, torch.device("meta"), plan.dtype
    hq, hkv, _ = local_heads(m, plan.parallel)
    d, h, i32 = m.head_dim, m.hidden_size, {"dtype": torch.int32, "device": dev}
    n = (hq + 2 * hkv) * d
    norm = (torch.ones(d, dtype=dt, device=dev), torch.ones(d, dtype=dt, device=dev)) if m.qk_norm else (None, None)
    return qkv_gemv_decode_attention(
        torch.zeros((1, h), dtype=dt, device=dev), torch.zeros((n, h), dtype=dt, device=dev),
        torch.zeros(n, dtype=dt, device=dev) if m.qkv_bias else None, torch.zeros(1, **i32),
        torch.zeros((8, m.rotary_dim), dtype=torch.float32, device=dev), hq, hkv, d,
        torch.zeros((2, 2, plan.config.page_size, hkv, d), dtype=plan.kv_dtype, device=dev),
        torch.zeros(1, **i32), torch.ones(1, **i32), torch.zeros(2, **i32), *norm, eps=m.rms_norm_eps,
        scale=d ** -0.5, workspace=DecodeWorkspace(1, hq, hkv, d, dev, num_sms=132))


def launch_layer_kernel(plan, moe_layer=None) -> None:
    """The one-token attention half in one kernel (``moeserve.ops.attention.layer_triton``) as the engine launches
    it for this plan, on ``meta`` tensors: with the router's GEMM for MoE layers whose routing kernel takes it
    (then the routing kernel on its single partial sum, and the MoE layer after it), without for dense layers."""
    from moeserve.models.parallel import local_heads
    from moeserve.ops.attention.layer_triton import LayerWorkspace, attention_half
    from moeserve.ops.moe.routing_config import RouterPartials
    m, dev, dt = plan.arch, torch.device("meta"), plan.dtype
    hq, hkv, _ = local_heads(m, plan.parallel)
    d, h, i32 = m.head_dim, m.hidden_size, dict(dtype=torch.int32, device=dev)
    ws = LayerWorkspace(h, hq, hkv, d, dt, dev, num_sms=132)
    norm = (torch.ones(d, dtype=dt, device=dev), torch.ones(d, dtype=dt, device=dev)) if m.qk_norm else (None, None)
    nqkv = (hq + 2 * hkv) * d
    e = lambda *shape: torch.empty(*shape, dtype=dt, device=dev)  # noqa: E731
    # MoE layers hand the kernel their router where the routing kernel takes its GEMM and the kernel has programs
    # enough for its rows (as DecoderLayer and the attention backend decide); dense layers never do
    router = moe_layer.gate.weight if moe_layer is not None and moe_layer.router_gemm_split(1) else None
    if router is not None and not ws.takes_router(router.shape[0]):
        router = None
    kinds = {router is not None and m.layer_is_moe(i) for i in range(m.num_layers)}
    for with_router in sorted(kinds):
        r = router if with_router else None
        x, parts = attention_half(
            e(1, h), e(1, h), e(h), e(nqkv, h), e(nqkv) if m.qkv_bias else None, e(h, hq * d), e(h),
            m.rms_norm_eps, torch.zeros(1, **i32), torch.zeros((8, m.rotary_dim), dtype=torch.float32, device=dev),
            hq, hkv, d, torch.zeros((2, 2, plan.config.page_size, hkv, d), dtype=plan.kv_dtype, device=dev),
            torch.zeros(1, **i32), torch.zeros(1, **i32), torch.zeros(2, **i32), *norm, m.rms_norm_eps, d ** -0.5,
            ws, router=r)
        if parts is not None:
            moe_layer(x, None, RouterPartials(parts, r.shape[0], r.dtype))


def _pdl_step_sizes(pdl_bound: int, largest: int) -> list[int]:
    """Step sizes that cover a kernel compiled once for every step size (the token count is its grid) up to
    ``largest`` tokens: one token, and one past the PDL bound where steps go beyond it (launched without PDL)."""
    return [1] + ([pdl_bound + 1] if 0 < pdl_bound < largest else [])


def launch_every_kernel(plan, on_step=None) -> None:
    """Run, on ``meta`` tensors, every Triton launch the plan can make: the attention's QKV kernel (and the QKV
    GEMV with the decode attention in one grid, where ``qkv_gemv_triton.QKV_IN_GRID`` is on), the MoE layer
    (router, routing, fused MoE, combine) for each step size from 1 to the largest, the residual add + RMSNorm of
    small steps and their embedding with the first norm, the decode graphs' input feed, the GEMV for each linear and
    small step, and the decode graphs' LM head with the greedy tokens in its epilogue. Inside
    ``compile_session`` each launch compiles (or lists) its kernel instead of running. ``on_step(t)`` is called
    before the step of ``t`` tokens, ``on_step(None)`` before the input feed and the GEMVs."""
    from moeserve.ops import pdl
    on_step = on_step or (lambda t: None)
    fp = plan.triton_fingerprint("?")
    meta = torch.device("meta")
    with torch.no_grad(), pdl.enabled_as(fp["pdl_max_tokens"]):  # PDL launches are their own compiles
        if fp["fused_qkv"]:
            for tokens in _pdl_step_sizes(fp["pdl_max_tokens"], plan.max_step_tokens):
                on_step(tokens)
                launch_qkv_kernel(plan, tokens)
        if fp["decode_max_tokens"]:
            for tokens in _pdl_step_sizes(fp["pdl_max_tokens"], fp["decode_max_tokens"]):
                on_step(tokens)
                launch_decode_kernel(plan, tokens)
            from moeserve.ops.attention import qkv_gemv_triton
            if qkv_gemv_triton.QKV_IN_GRID and plan.quantization == "none":  # (an A/B switch, off by default)
                on_step(1)
                launch_qkv_gemv_kernel(plan)
        layer = meta_moe_layer(plan) if fp["moe"] or fp["routing"] else None
        if fp.get("layer_kernel"):
            on_step(1)
            launch_layer_kernel(plan, layer)
        if layer is not None:
            h = plan.arch.hidden_size
            norm_w = torch.empty(h, dtype=plan.dtype, device=meta)
            for tokens in range(1, plan.max_step_tokens + 1):
                on_step(tokens)
                x = torch.empty((tokens, h), dtype=plan.dtype, device=meta)
                layer.after_attention(x, torch.empty_like(x), norm_w, plan.arch.rms_norm_eps, norm_w)  # as the model
        if fp.get("norm_triton_max_tokens"):
            from moeserve.ops.norm_triton import add_rmsnorm
            h = plan.arch.hidden_size
            for tokens in _pdl_step_sizes(fp["pdl_max_tokens"], fp["norm_triton_max_tokens"]):
                on_step(tokens)
                x = torch.empty((tokens, h), dtype=plan.dtype, device=meta)
                add_rmsnorm(x, torch.empty_like(x), torch.empty(h, dtype=plan.dtype, device=meta), 1e-6)
                if not plan.parallel.is_parallel:  # the step's embedding and first norm (FlashInferNorm.embed_rmsnorm)
                    from moeserve.ops.norm_triton import embed_rmsnorm
                    embed_rmsnorm(torch.empty(tokens, dtype=torch.int32, device=meta),
                                  torch.empty((plan.arch.vocab_size, h), dtype=plan.dtype, device=meta),
                                  torch.empty(h, dtype=plan.dtype, device=meta), 1e-6)
        on_step(None)
        if fp.get("decode_graphs"):  # before each decode graph's replay
            from moeserve.ops.inputs_triton import feed_step_inputs
            i32 = torch.empty(1, dtype=torch.int32, device=meta)
            feed_step_inputs(i32, i32, i32, i32, i32, i32, torch.empty(1, dtype=torch.int64, device=meta))
        if fp["gemv_max_tokens"]:
            from moeserve.ops.linear_triton import TritonLinear, gemv
            lin = TritonLinear(meta, plan.dtype, max_tokens=fp["gemv_max_tokens"])
            for n, k, bias, wdtype in meta_linear_shapes(plan, fp):
                for rows in range(1, lin.max_tokens + 1):
                    if lin.takes_shape(rows, n, plan.dtype, wdtype):
                        gemv(torch.empty((rows, k), dtype=plan.dtype, device=meta),
                             torch.empty((n, k), dtype=wdtype, device=meta),
                             torch.empty((n,), dtype=wdtype, device=meta) if bias else None)
            if fp.get("decode_graphs") and not plan.parallel.is_parallel:  # the graphs' LM head with its argmax
                from moeserve.ops.linear_triton import gemv_argmax, gemv_row_config
                n, k = plan.arch.vocab_size, plan.arch.hidden_size
                for rows in range(1, lin.max_tokens + 1):  # as TritonLinear.linear_argmax decides
                    if lin.takes_shape(rows, n, plan.dtype, plan.dtype) and gemv_row_config(n, k) is None:
                        gemv_argmax(torch.empty((rows, k), dtype=plan.dtype, device=meta),
                                    torch.empty((n, k), dtype=plan.dtype, device=meta), lin.argmax_slots)


def list_kernels(plan, capability: tuple[int, int], device_name: str, scratch: Path) -> list[dict]:
    """The Triton kernels (name, tile constants, warps, stages) the plan launches, compiling nothing."""
    if not plan.triton_fingerprint(device_name)["kernels"]:
        return []
    from triton.runtime.cache import triton_key
    with tuned_tables_for(device_name), compile_session(scratch, capability, triton_key(), dry_run=True):
        launch_every_kernel(plan)
        return list(_LISTED.values())


def build(plan, out: Path, capability: tuple[int, int], device_name: str, target_python: str | None = None,
          log=print) -> dict:
    """Compile the plan's Triton kernels into ``out/triton`` and add them to its manifest; returns the manifest
    entry of this configuration."""
    import triton
    fingerprint = plan.triton_fingerprint(device_name)
    if not fingerprint["kernels"]:
        return {"fingerprint": fingerprint, "entries": []}
    key, tag = target_triton_key(target_python)
    cache_dir = out / TRITON_DIR
    t0 = time.perf_counter()
    marks: list[tuple[int, int | None]] = []  # (events so far, the step size about to launch)
    with tuned_tables_for(device_name), compile_session(cache_dir, capability, key) as events:
        launch_every_kernel(plan, on_step=lambda t: marks.append((len(events), t)))
    entries, seen = [], set()
    from triton.runtime.cache import _base32
    for i, e in enumerate(events):
        if e["hash"] not in seen:
            seen.add(e["hash"])
            # the MoE step size whose launch first needs this kernel: the engine warms these sizes at start
            tokens = next((t for n, t in reversed(marks) if n <= i), None)
            entries.append({"kernel": e["name"], "name": e["name"][:150], "dir": _base32(e["hash"]),
                            "hash": e["hash"], "constants": e["constants"], "tokens": tokens,
                            "cached": e["cache_hit"]})
    compiled = sum(1 for e in entries if not e["cached"])
    log(f"Triton: {len(entries)} kernels for {plan.source.name} up to {plan.max_step_tokens} tokens per step "
        f"({compiled} compiled now, for {device_name}, Python {tag}) in {time.perf_counter() - t0:.1f} s -> {cache_dir}")
    config = {"fingerprint": fingerprint, "entries": [{k: v for k, v in e.items() if k != "cached"} for e in entries]}
    manifest = _read(cache_dir) or {}
    if (manifest.get("triton_version"), manifest.get("target_python")) != (triton.__version__, tag):
        manifest = {}
    launchers = set(manifest.get(LAUNCHERS) or [])
    (cache_dir / LAUNCHERS).mkdir(exist_ok=True)
    for src in {e["launcher"] for e in events if e.get("launcher")}:
        name = hashlib.sha256(src.encode()).hexdigest()[:24] + ".c"
        (cache_dir / LAUNCHERS / name).write_text(src)
        launchers.add(name)
    digest = hashlib.sha256(key.encode()).hexdigest()
    same = {k: v for k, v in fingerprint.items() if k != "max_tokens"}
    configs = [c for c in manifest.get("configs", [])
               if {k: v for k, v in c["fingerprint"].items() if k != "max_tokens"} != same]
    manifest = {"format": MANIFEST_FORMAT, "triton_version": triton.__version__, "target_python": tag,
                "triton_key_sha256": digest, "capability": list(capability), "configs": configs + [config],
                LAUNCHERS: sorted(launchers)}
    (cache_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return config


def _read(cache_dir: Path) -> dict | None:
    try:
        return json.loads((cache_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def size_bytes(cache_dir: Path) -> int:
    return sum(p.stat().st_size for p in cache_dir.rglob("*") if p.is_file())
