"""From a configuration to what will run: the one place a config is resolved into the model's
architecture, the device, the dtypes, the weight format and the backend of every operator.

The engine, ``moeserve env``, ``moeserve precompile`` and the benchmark all call ``resolve_plan``; a
problem with the combination (a backend this GPU cannot run, a ``max_model_len`` beyond the model's, a
GPU architecture other than the one asked for) is raised here, before anything is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve import backends
from moeserve.config import EngineConfig, ModelSource, resolve_dtype, resolve_model_source
from moeserve.hardware import HardwareInfo, check_gpu_arch, probe, resolve_device
from moeserve.models import arch_from_hf
from moeserve.models.arch import ArchConfig
from moeserve.models.parallel import check_parallel
from moeserve.ops.parallel import Parallel
from moeserve.quant.config import engine_quantization


@dataclass
class RuntimePlan:
    config: EngineConfig
    source: ModelSource
    arch: ArchConfig
    hardware: HardwareInfo
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    quantization: str  # none | fp8
    max_model_len: int
    backends: dict[str, backends.BackendSpec]
    parallel: Parallel  # this rank's place among the GPUs (the default group: every rank of the engine)
    local_rank: int = 0  # this rank's GPU on its host

    @property
    def rank(self) -> int:
        return self.parallel.tp_rank

    @property
    def backend_names(self) -> dict[str, str]:
        return {op: spec.name for op, spec in self.backends.items()}

    def backend_class(self, op: str):
        return backends.load(self.backends[op])

    def explicit(self, op: str) -> bool:
        """Whether the config named this operator's backend (rather than ``auto``)."""
        return getattr(self.config.backends, op) != "auto"

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step can feed the model."""
        return max(self.config.max_num_batched_tokens, self.config.max_num_seqs)

    def flashinfer_modules(self, arch=None) -> list:
        """The FlashInfer JIT modules this plan's backends load (``KernelModule`` list, each once), for the GPU
        architecture ``arch`` (default: the plan's device)."""
        from moeserve.kernel_cache.layout import parse_arch
        from moeserve.kernel_cache.modules import Target
        if arch is None:
            arch = parse_arch(self.hardware.gpus[self.device.index or 0].arch)
        m = self.arch
        target = Target(arch, self.dtype, self.kv_dtype, m.num_heads, m.num_kv_heads, m.head_dim, self.quantization,
                        m.num_experts, m.routing)
        out, seen = [], set()
        for op in backends.OPERATORS:
            fn = self.backends[op].flashinfer_modules
            for mod in backends.load_target(fn)(target) if fn else []:
                if (mod.gen, mod.args) not in seen:
                    seen.add((mod.gen, mod.args))
                    out.append(mod)
        return out

    @property
    def fused_qkv(self) -> bool:
        """Whether attention takes the QKV projection whole (``moeserve.ops.attention.qkv_triton``): FlashInfer
        attention, a GPU rotary backend, the KV cache in the model's dtype, and ``attention_fused_qkv``."""
        names = self.backend_names
        return (self.config.attention_fused_qkv and names.get("attention") == "flashinfer"
                and names.get("rope") == "flashinfer" and self.kv_dtype == self.dtype)

    @property
    def triton_decode_max_tokens(self) -> int:
        """Decode steps of at most this many tokens run the one-kernel Triton decode attention
        (``moeserve.ops.attention.decode_triton``): ``attention_decode_triton_max_tokens`` on the fused QKV path
        with a rotary width the kernel takes (the head, or at least 16 short of it), up to the largest step."""
        from moeserve.ops.attention import decode_kernel_takes_rotary
        m = self.arch
        if not self.fused_qkv or not decode_kernel_takes_rotary(m.head_dim, m.rotary_dim):
            return 0
        return min(self.config.attention_decode_triton_max_tokens, self.max_step_tokens)

    @property
    def layer_kernel(self) -> bool:
        """Whether one-token decode steps run each layer's attention half in one persistent kernel
        (``moeserve.ops.attention.layer_triton``, ``attention_layer_kernel``): on the one-kernel Triton decode
        path, one rank, unquantised bf16/fp16 weights, no output-projection bias, not under torch.compile."""
        return (self.config.attention_layer_kernel and self.triton_decode_max_tokens >= 1
                and not self.parallel.is_parallel and self.quantization == "none" and not self.arch.o_bias
                and self.dtype in (torch.bfloat16, torch.float16) and not self.config.torch_compile)

    @property
    def _moe_norm_folds(self) -> bool:
        """Whether the MoE combine may apply the next norm at all (where the MoE backend can,
        ``MoEBackend.fuses_norm``): unquantised experts of one rank, not under torch.compile."""
        return self.quantization == "none" and not self.parallel.is_parallel and not self.config.torch_compile

    @property
    def moe_fuse_norm_max_tokens(self) -> int:
        """Steps of at most this many tokens fold the next norm into the MoE combine (``moe_fuse_norm_max_tokens``;
        every step with ``moe_fuse_norm``)."""
        if not self._moe_norm_folds:
            return 0
        return self.max_step_tokens if self.config.moe_fuse_norm else self.config.moe_fuse_norm_max_tokens

    @property
    def moe_fuse_norm_in_grid(self) -> bool:
        """Whether one-token steps that route in the fused MoE's grid fold the next norm into its combine
        (``moe_fuse_norm_in_grid``); not with the one-kernel attention half (``attention_layer_kernel``), which adds
        the residual and applies the input norm itself and runs only where no layer before did."""
        return (self.config.moe_fuse_norm_in_grid and self.moe_route_in_grid and self._moe_norm_folds
                and not self.layer_kernel)

    @property
    def moe_fused_shared_early(self) -> bool:
        """Whether one-token steps start the fused shared expert's tiles of the Triton MoE while the routing runs
        (``moe_fused_shared_early``; with the shared expert fused into the Triton MoE for one-token steps)."""
        return (self.config.moe_fused_shared_early and self.fused_shared_expert_steps is not None
                and self.backends["moe"].name == "triton")

    @property
    def moe_route_in_grid(self) -> bool:
        """Whether one-token steps route inside the fused MoE's first grid (``moe_route_in_grid``; with the shared
        expert fused into the Triton MoE and started early, the Triton router taking its GEMM, no
        ``router_fuse_norm``)."""
        from moeserve.ops.moe.routing_triton import METHODS
        return (self.config.moe_route_in_grid and self.moe_fused_shared_early
                and self.backends["routing"].name == "fused" and self.arch.routing.method in METHODS
                and self.config.router_split_k_max_tokens >= 1 and not self.router_fuse_norm)

    @property
    def router_fuse_norm(self) -> bool:
        """Whether small steps fold the post-attention norm into the router's partial sums (``router_fuse_norm``;
        where the router takes its GEMM): one rank, not under torch.compile."""
        return self.config.router_fuse_norm and not self.parallel.is_parallel and not self.config.torch_compile

    @property
    def norm_triton_max_tokens(self) -> int:
        """Steps of at most this many tokens run the residual add + RMSNorm in Triton
        (``moeserve.ops.norm_triton``, ``norm_triton_max_tokens``): the FlashInfer norm backend on a GPU, up to the
        largest step."""
        if self.device.type != "cuda" or self.backends["norm"].name != "flashinfer":
            return 0
        return min(self.config.norm_triton_max_tokens, self.max_step_tokens)

    @property
    def pdl_max_tokens(self) -> int:
        """Steps of at most this many tokens launch moeserve's Triton kernels with programmatic dependent launch
        (``moeserve.ops.pdl``): ``pdl_max_tokens`` on a GPU of compute capability 9.0 or later, else 0."""
        if self.device.type != "cuda":
            return 0
        gpus = self.hardware.gpus
        i = self.device.index or 0
        return self.config.pdl_max_tokens if i < len(gpus) and gpus[i].capability >= (9, 0) else 0

    @property
    def fused_shared_expert_steps(self) -> int | None:
        """Which steps run the shared expert inside the fused MoE (``SparseMoE.fuse_shared_expert``): None no step,
        0 every step (``moe_fuse_shared_expert``), ``n`` the steps of at most ``n`` tokens
        (``moe_fuse_shared_expert_max_tokens``, where it applies: :func:`fuse_shared_expert_unsupported`, the Triton
        or torch MoE, no torch.compile)."""
        cfg = self.config
        if cfg.moe_fuse_shared_expert:
            return 0
        n = min(cfg.moe_fuse_shared_expert_max_tokens, self.max_step_tokens)
        if (n and fuse_shared_expert_unsupported(self.arch, self.quantization, self.parallel.tp_size) is None
                and self.backends["moe"].name in ("triton", "torch") and not cfg.torch_compile):
            return n
        return None

    def triton_fingerprint(self, device_name: str) -> dict:
        """What decides the Triton kernels this plan launches (``moeserve.kernel_cache.triton_cache``): the MoE
        shapes, routing, dtypes, the tensor-parallel split, the largest step, the GPU's tuned-config name and the
        kernels' source."""
        from moeserve.ops.moe.routing_triton import METHODS
        m = self.arch
        moe = self.backends["moe"].name == "triton"
        routing = self.backends["routing"].name == "fused" and m.routing.method in METHODS
        gemv = self.config.linear_gemv_max_tokens if self.backends["linear"].name == "triton" else 0
        gated = bool(m.shared_expert_intermediate_size and m.shared_expert_gate)
        qkv = self.fused_qkv
        fused = self.fused_shared_expert_steps
        norm = self.norm_triton_max_tokens
        graphs = bool(self.config.graph_batch_sizes())  # their replays feed the step's ids (ops.inputs_triton)
        return {"kernels": moe or routing or gemv > 0 or qkv or norm > 0 or graphs, "moe": moe,
                "decode_graphs": graphs,
                "routing": m.routing.method if routing else None, "fused_qkv": qkv,
                "decode_max_tokens": self.triton_decode_max_tokens, "layer_kernel": self.layer_kernel,
                "gemv_max_tokens": gemv, "norm_triton_max_tokens": norm,
                "moe_pairwise_max_tokens": self.config.moe_pairwise_max_tokens if moe else 0,
                "fuse_shared_expert": fused is not None,
                "fuse_shared_expert_pieces": self.config.moe_fuse_shared_expert_pieces if fused is not None else 0,
                "fuse_shared_expert_max_tokens": fused or 0,
                "fused_shared_early": self.moe_fused_shared_early,
                "route_in_grid": self.moe_route_in_grid,
                "fuse_norm": moe and (self.moe_fuse_norm_max_tokens > 0 or self.moe_fuse_norm_in_grid),
                "fuse_norm_max_tokens": self.moe_fuse_norm_max_tokens if moe else 0,
                "fuse_norm_in_grid": moe and self.moe_fuse_norm_in_grid,
                "router_fuse_norm": (bool(routing) and self.config.router_split_k_max_tokens > 0
                                     and self.router_fuse_norm),
                "router_split_k_max_tokens": self.config.router_split_k_max_tokens if routing else 0,
                "pdl_max_tokens": min(self.pdl_max_tokens, self.max_step_tokens),
                "renormalize": m.routing.renormalize, "hidden_size": m.hidden_size, "num_experts": m.num_experts,
                "moe_intermediate_size": m.moe_intermediate_size, "top_k": m.top_k,
                "shared_expert": bool(m.shared_expert_intermediate_size),
                "shared_gate": ("router" if not m.router_fp32 else "linear") if gated else None,
                "router_dtype": "float32" if m.router_fp32 else str(self.dtype).removeprefix("torch."),
                "dtype": str(self.dtype).removeprefix("torch."), "quantization": self.quantization,
                # a rank's linears and experts are its split (moeserve.tools.triton_aot.meta_linear_shapes,
                # meta_moe_layer): its slice of each expert's intermediate size, or its share of the experts
                "tensor_parallel_size": self.parallel.tp_size, "expert_parallel_size": self.parallel.ep_size,
                "device_name": device_name, "code": triton_source_digest(), "max_tokens": self.max_step_tokens}


def fuse_shared_expert_unsupported(arch: ArchConfig, quantization: str, tp: int) -> str | None:
    """None when the shared expert can run inside the fused MoE (``SparseMoE.fuse_shared_expert``), else why not."""
    return ("the model has no shared expert" if not arch.shared_expert_intermediate_size else
            f"quantization is {quantization} (needs unquantised experts)" if quantization != "none" else
            f"tensor_parallel_size is {tp} (needs one GPU)" if tp > 1 else
            "the shared expert's gate is computed in float32 apart from the router"
            if arch.shared_expert_gate and arch.router_fp32 else None)


def triton_source_digest() -> str:
    """sha256 (16 hex digits) of moeserve's Triton kernel sources: an edit invalidates their cache entries."""
    import hashlib
    from pathlib import Path

    import moeserve.ops as ops_pkg
    root = Path(ops_pkg.__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        text = f.read_bytes()
        if b"@triton.jit" in text:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + text)
    return h.hexdigest()[:16]


def resolve_plan(cfg: EngineConfig, hw: HardwareInfo | None = None, device: torch.device | None = None,
                 source: ModelSource | None = None, with_backends: bool = True, rank: int = 0,
                 local_rank: int = 0) -> RuntimePlan:
    """Resolve ``cfg`` for this machine (``hw``/``device`` default to the probe and ``cfg.device``), or for a
    described target machine when both are given (``moeserve precompile --arch``). ``with_backends=False``
    leaves ``backends`` empty (a report that must stand even when a backend cannot run). With
    ``tensor_parallel_size > 1``, ``rank`` is this process's rank and its GPU is ``cuda:local_rank``."""
    real = hw is None
    hw = probe() if hw is None else hw
    device = resolve_device(cfg.device) if device is None else device
    tp = cfg.tensor_parallel_size
    if tp > 1 and device.type == "cuda" and real:
        visible = len(hw.gpus)
        if local_rank >= visible:
            raise RuntimeError(f"tensor_parallel_size {tp}: local rank {local_rank} needs GPU {local_rank} but "
                               f"this host has {visible} visible GPU(s)")
        device = torch.device("cuda", local_rank)
    if real:
        check_gpu_arch(cfg.gpu_arch, device)
    source = source or resolve_model_source(cfg.model, cfg.weights_dir, cfg.revision)
    arch = arch_from_hf(source.config)
    dtype = resolve_dtype(cfg.dtype, arch.torch_dtype, device)
    if cfg.kv_cache_dtype != "auto":
        raise NotImplementedError(f"kv_cache_dtype: {cfg.kv_cache_dtype!r} is not supported by this build "
                                  "(the KV cache is kept in the model dtype; use kv_cache_dtype: auto)")
    max_model_len = cfg.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(f"max_model_len: {max_model_len} exceeds the model's max_position_embeddings "
                         f"({arch.max_position_embeddings})")
    quantization = engine_quantization(cfg, source.config)
    check_parallel(arch, tp, cfg.enable_expert_parallel, quantization)
    if cfg.moe_fuse_shared_expert_pieces and not (cfg.moe_fuse_shared_expert
                                                  or cfg.moe_fuse_shared_expert_max_tokens):
        raise ValueError("moe_fuse_shared_expert_pieces: set moe_fuse_shared_expert: true or "
                         "moe_fuse_shared_expert_max_tokens above 0 as well (the pieces say how much of the shared "
                         "expert moves into the fused MoE)")
    if cfg.moe_fuse_shared_expert:
        why = fuse_shared_expert_unsupported(arch, quantization, tp)
        if why:
            raise ValueError(f"moe_fuse_shared_expert: {why}")
    ep = tp if cfg.enable_expert_parallel else 1
    dispatch = "allreduce" if cfg.expert_parallel_dispatch == "auto" else cfg.expert_parallel_dispatch
    parallel = Parallel(tp, rank, ep, rank if ep > 1 else 0, dispatch)
    specs = {op: backends.resolve(op, getattr(cfg.backends, op), hw, device, dtype, quantization, arch.head_dim)
             for op in backends.OPERATORS} if with_backends else {}
    return RuntimePlan(cfg, source, arch, hw, device, dtype, dtype, quantization, max_model_len, specs, parallel,
                       local_rank)
