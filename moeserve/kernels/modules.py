"""Which FlashInfer JIT modules an engine configuration loads on a given GPU architecture.

The table ``MODULE_TABLE`` maps (operator, backend) to a function that lists the modules that backend
loads for one ``Target`` (the model's shapes, the dtype, the architecture). To cover a new backend or
kernel, add a function and a table row. Each module is a ``KernelModule``: a FlashInfer generator
(``flashinfer.jit....:gen_*``) and the arguments the backend calls it with, as plain data, so that a
subprocess with FlashInfer's environment set can rebuild the ``JitSpec``. Torch dtypes are written as
strings ``"torch.bfloat16"``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from moeserve.config import EngineConfig, resolve_model_source
from moeserve.hardware import GPUInfo, HardwareInfo
from moeserve.kernels.layout import Arch, parse_arch
from moeserve.ops import registry
from moeserve.ops.names import OPERATORS

PREFILL_GEN = "flashinfer.jit.attention.modules:gen_batch_prefill_module"
DECODE_GEN = "flashinfer.jit.attention.modules:gen_batch_decode_module"


@dataclass(frozen=True)
class KernelModule:
    key: str  # short name for `moeserve precompile --modules`
    op: str
    backend: str
    label: str
    gen: str  # "module:function" returning a flashinfer JitSpec
    args: tuple = ()
    weight: int = 1  # relative compile cost; the biggest modules start first

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Target:
    """What decides the modules: the GPU target and the model as the engine will run it."""

    arch: Arch
    dtype: torch.dtype
    kv_dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    quantization: str = "none"
    num_experts: int = 0
    routing: object = None  # moeserve.ops.moe.routing.RoutingConfig


def dtype_arg(dtype: torch.dtype) -> str:
    return str(dtype)  # "torch.bfloat16"


def short_dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(dtype, str(dtype).removeprefix("torch."))


# --- one function per operator backend --------------------------------------------------------------

def _is_16bit(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


def prefill_backend(t: Target) -> str:
    """What FlashInfer's ``determine_attention_backend`` picks for moeserve's causal, mask-free, RoPE-free
    prefill: FA3 on sm90 unless the KV cache is fp8 under a 16-bit query, FA2 elsewhere."""
    fp8_kv_16bit_q = not _is_16bit(t.kv_dtype) and _is_16bit(t.dtype)
    return "fa3" if t.arch.major == 9 and not fp8_kv_16bit_q else "fa2"


def _attention_args(t: Target) -> tuple:
    # q, kv, o dtypes, index dtype, head_dim_qk, head_dim_vo, pos_encoding_mode (none), use_sliding_window,
    # use_logits_soft_cap
    return (dtype_arg(t.dtype), dtype_arg(t.kv_dtype), dtype_arg(t.dtype), "torch.int32", t.head_dim, t.head_dim,
            0, False, False)


def attention_flashinfer(t: Target) -> list[KernelModule]:
    """Paged prefill, decode (tensor-core decode reuses an FA2 prefill module when the GQA group is >= 4),
    and the KV append kernel (``page``)."""
    dt, hd = short_dtype(t.dtype), t.head_dim
    backend = prefill_backend(t)
    mods = [KernelModule("prefill", "attention", "flashinfer", f"paged prefill {backend} {dt} hd{hd}", PREFILL_GEN,
                         (backend,) + _attention_args(t) + (False,), weight=60 if backend == "fa3" else 40)]
    if t.num_heads // t.num_kv_heads >= 4:
        if backend != "fa2":
            mods.append(KernelModule("decode", "attention", "flashinfer", f"tensor-core decode (fa2 prefill) {dt} hd{hd}",
                                     PREFILL_GEN, ("fa2",) + _attention_args(t) + (False,), weight=40))
    else:
        mods.append(KernelModule("decode", "attention", "flashinfer", f"decode {dt} hd{hd}", DECODE_GEN,
                                 _attention_args(t), weight=10))
    mods.append(KernelModule("page", "attention", "flashinfer", "paged KV append", "flashinfer.jit.page:gen_page_module",
                             weight=5))
    return mods


def norm_flashinfer(t: Target) -> list[KernelModule]:
    return [KernelModule("norm", "norm", "flashinfer", "RMSNorm (CUDA)", "flashinfer.jit.norm:gen_norm_module", weight=15)]


def rope_flashinfer(t: Target) -> list[KernelModule]:
    return [KernelModule("rope", "rope", "flashinfer", "RoPE", "flashinfer.jit.rope:gen_rope_module", weight=15)]


def activation_flashinfer(t: Target) -> list[KernelModule]:
    return [KernelModule("silu_and_mul", "activation", "flashinfer", "SiLU and mul",
                         "flashinfer.jit.activation:gen_act_and_mul_module", ("silu",), weight=3)]


def sampling_flashinfer(t: Target) -> list[KernelModule]:
    return [KernelModule("sampling", "sampling", "flashinfer", "sampling (top-k/top-p/min-p)",
                         "flashinfer.jit.sampling:gen_sampling_module", weight=50)]


CUTLASS_MOE_GEN = {
    (8, 9): "gen_cutlass_fused_moe_sm89_module", (9, 0): "gen_cutlass_fused_moe_sm90_module",
    (10, 0): "gen_cutlass_fused_moe_sm100_module", (10, 3): "gen_cutlass_fused_moe_sm103_module",
    (11, 0): "gen_cutlass_fused_moe_sm100_module", (12, 0): "gen_cutlass_fused_moe_sm120_module",
    (12, 1): "gen_cutlass_fused_moe_sm120_module",
}


def moe_flashinfer(t: Target) -> list[KernelModule]:
    """``cutlass_fused_moe``: one module per architecture family with every dtype in it, built the FAST_BUILD
    way (see ``moeserve.kernels.specs.gen_cutlass_fused_moe_fast_build``)."""
    gen = CUTLASS_MOE_GEN.get(t.arch.capability)
    if gen is None:
        return []
    return [KernelModule("fused_moe", "moe", "flashinfer", f"CUTLASS fused MoE ({t.arch.sm}, FAST_BUILD tiles)",
                         "moeserve.kernels.specs:gen_cutlass_fused_moe_fast_build", (gen,), weight=100)]


def routing_fused(t: Target) -> list[KernelModule]:
    """FlashInfer's fused DeepSeek-V3 top-k, which the fused routing backend installs when the model's
    routing fits it (``moeserve.ops.moe.routing.fused_deepseek_unsupported`` decides). Softmax and Llama-4
    routing run moeserve's Triton kernel, which FlashInfer does not build."""
    if t.routing is None or getattr(t.routing, "method", None) != "deepseek_v3":
        return []
    from moeserve.ops.moe.routing import fused_deepseek_unsupported
    if fused_deepseek_unsupported(t.routing, t.num_experts, t.arch.capability) is not None:
        return []
    return [KernelModule("routing", "routing", "fused", "fused DeepSeek-V3 top-k routing",
                         "flashinfer.jit.dsv3_optimizations:gen_dsv3_fused_routing_module", weight=10)]


def linear_flashinfer(t: Target) -> list[KernelModule]:
    """The SM90 FP8 block-scale GEMM behind the FP8 linear backend."""
    if t.arch.major != 9:
        return []
    return [KernelModule("fp8_gemm", "linear", "flashinfer", "FP8 block-scale GEMM (sm90)",
                         "flashinfer.jit.gemm.fp8_blockscale:gen_fp8_blockscale_gemm_sm90_module", (False,), weight=70)]


MODULE_TABLE = {
    ("attention", "flashinfer"): attention_flashinfer,
    ("norm", "flashinfer"): norm_flashinfer,
    ("rope", "flashinfer"): rope_flashinfer,
    ("activation", "flashinfer"): activation_flashinfer,
    ("sampling", "flashinfer"): sampling_flashinfer,
    ("moe", "flashinfer"): moe_flashinfer,
    ("routing", "fused"): routing_fused,
    ("linear", "flashinfer"): linear_flashinfer,
}


# --- from a configuration ---------------------------------------------------------------------------

def hardware_for_arch(arch: Arch) -> HardwareInfo:
    """A machine with one GPU of ``arch``, for asking the registry what would run there."""
    gpu = GPUInfo(0, f"target {arch.name}", arch.capability, 0, 0)
    return HardwareInfo(device_type="cuda", gpus=[gpu])


def target_for_config(cfg: EngineConfig, arch: Arch | str) -> tuple[Target, dict[str, str]]:
    """The target and the backend each operator resolves to, for ``cfg`` on a GPU of ``arch``."""
    from moeserve.engine.runner import resolve_dtype
    from moeserve.models import arch_from_hf
    from moeserve.quant.config import engine_quantization

    arch = parse_arch(arch) if isinstance(arch, str) else arch
    source = resolve_model_source(cfg.model, cfg.weights_dir)
    model = arch_from_hf(source.config)
    device = torch.device("cuda", 0)
    dtype = resolve_dtype(cfg.dtype, model.torch_dtype, device)
    kv_dtype = dtype if cfg.kv_cache_dtype == "auto" else torch.float8_e4m3fn
    hw = hardware_for_arch(arch)
    quantization = engine_quantization(cfg, source.config)
    backends = {op: registry.resolve(op, getattr(cfg.backends, op), hw, device, dtype, quantization,
                                     model.head_dim).name
                for op in OPERATORS}
    target = Target(arch, dtype, kv_dtype, model.num_heads, model.num_kv_heads, model.head_dim, quantization,
                    model.num_experts, model.routing)
    return target, backends


def modules_for_config(cfg: EngineConfig, arch: Arch | str) -> list[KernelModule]:
    """Every FlashInfer JIT module the engine configured by ``cfg`` loads on ``arch``, each once."""
    target, backends = target_for_config(cfg, arch)
    out: list[KernelModule] = []
    seen: set[tuple] = set()
    for op in OPERATORS:
        fn = MODULE_TABLE.get((op, backends[op]))
        for m in fn(target) if fn else []:
            ident = (m.gen, m.args)
            if ident not in seen:
                seen.add(ident)
                out.append(m)
    return out


def select_modules(modules: list[KernelModule], keys: str | None) -> list[KernelModule]:
    """The modules named in ``keys`` ("norm,rope"); all of them when None."""
    if not keys:
        return modules
    wanted = [k.strip() for k in keys.split(",") if k.strip()]
    known = {m.key for m in modules}
    unknown = [k for k in wanted if k not in known]
    if unknown:
        raise ValueError(f"--modules: {', '.join(unknown)} not among the modules this config loads "
                         f"({', '.join(m.key for m in modules)})")
    return [m for m in modules if m.key in wanted]
