"""The operators moeserve dispatches, the backends of each, and what each backend needs: the one table
every other part reads (config validation, backend resolution, ``moeserve env``, the kernel modules
``moeserve precompile`` builds).

Each backend states the device, compute capabilities and packages it needs. ``auto`` takes the first
backend in preference order that this machine can run; a backend named explicitly that cannot run is
refused with the reason (for example ``backends.moe: 'flashinfer' is not available: not on this GPU: needs
sm89, sm90, sm100, sm103 or sm120; this GPU is sm80``). Nothing falls back silently: the engine reports
what it picked.

A backend's class is named by a ``"module:attribute"`` string and imported only when it is used; so is the
function that lists the FlashInfer JIT modules it loads (``flashinfer_modules``), which ``moeserve
precompile`` builds ahead of time.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the table is read by every command's argument parser: torch loads only where it runs
    import torch

    from moeserve.hardware import HardwareInfo


@dataclass(frozen=True)
class Requirements:
    cuda: bool = False
    min_capability: tuple[int, int] | None = None
    capabilities: tuple[tuple[int, int], ...] | None = None  # an explicit list, when it is not a range
    packages: tuple[str, ...] = ()
    bf16_min_capability: tuple[int, int] = (8, 0)
    quantization: tuple[str, ...] | None = None  # weight formats it serves; None = any
    dtypes: tuple[str, ...] | None = None  # activation dtypes it serves (float16, bfloat16, ...); None = any
    head_dims: tuple[int, ...] | None = None  # attention head sizes it serves; None = any


@dataclass(frozen=True)
class BackendSpec:
    op: str
    name: str
    target: str  # "module:attribute" of the backend class, imported only when the backend is used
    needs: Requirements = field(default_factory=Requirements)
    description: str = ""
    # "module:function" taking a moeserve.kernel_cache.modules.Target and returning the FlashInfer JIT
    # modules this backend loads (KernelModule list); None when it loads none
    flashinfer_modules: str | None = None


def _sm(cc: tuple[int, int]) -> str:
    return f"sm{cc[0]}{cc[1]}"


_FI = ("flashinfer",)
_HALF = ("float16", "bfloat16")
_GPU = Requirements(cuda=True, min_capability=(7, 5), packages=_FI, dtypes=_HALF)
# FlashInfer's paged prefill (FA3 on sm90 static-asserts its head size) and decode kernels: 64, 128, 256.
_FI_ATTENTION = Requirements(cuda=True, min_capability=(7, 5), packages=_FI, dtypes=_HALF, head_dims=(64, 128, 256))

# Preference order for `auto`: first that can run wins.
SPECS: dict[str, list[BackendSpec]] = {
    "attention": [
        BackendSpec("attention", "flashinfer", "moeserve.ops.attention.flashinfer:FlashInferAttention", _FI_ATTENTION,
                    "FlashInfer paged prefill (fa3 on sm90) and decode",
                    "moeserve.ops.attention.flashinfer:flashinfer_modules"),
        BackendSpec("attention", "torch", "moeserve.ops.attention.torch_ref:TorchAttention", Requirements(),
                    "torch reference over the paged cache"),
    ],
    "moe": [
        BackendSpec("moe", "triton", "moeserve.ops.moe.triton_backend:TritonMoE",
                    Requirements(cuda=True, min_capability=(8, 0), packages=("triton",)),
                    "fused MoE Triton kernel with per-shape tuned configs"),
        BackendSpec("moe", "flashinfer", "moeserve.ops.moe.flashinfer_backend:FlashInferMoE",
                    Requirements(cuda=True, capabilities=((8, 9), (9, 0), (10, 0), (10, 3), (12, 0)), packages=_FI),
                    "FlashInfer cutlass_fused_moe (TensorRT-LLM grouped GEMMs)",
                    "moeserve.ops.moe.flashinfer_backend:flashinfer_modules"),
        BackendSpec("moe", "torch", "moeserve.ops.moe.torch_ref:TorchMoE", Requirements(),
                    "torch reference, one expert at a time"),
    ],
    "routing": [
        BackendSpec("routing", "fused", "moeserve.ops.moe.routing:FusedRouting",
                    Requirements(cuda=True, min_capability=(7, 5), packages=("triton",)),
                    "one top-k kernel per layer: FlashInfer fused_topk_deepseek (DeepSeek-V3), moeserve's "
                    "Triton kernel (softmax, Llama 4)", "moeserve.ops.moe.routing:flashinfer_modules"),
        BackendSpec("routing", "torch", "moeserve.ops.moe.routing:TorchRouting", Requirements(),
                    "torch softmax/sigmoid, top-k and renormalisation"),
    ],
    "linear": [
        BackendSpec("linear", "flashinfer", "moeserve.ops.linear:FlashInferFp8Linear",
                    Requirements(cuda=True, capabilities=((9, 0),), packages=_FI, quantization=("fp8",),
                                 dtypes=("bfloat16",)),
                    "FlashInfer SM90 FP8 block-scale GEMM (fp8_blockscale_gemm_sm90), bf16 activations",
                    "moeserve.ops.linear:flashinfer_modules"),
        # before torch: on a GPU auto takes the Triton GEMV for one-token steps (linear_gemv_max_tokens), the LM
        # head included, cuBLAS for every other step; on an H200 1.9% faster than cuBLAS at c=1 in one A/B
        BackendSpec("linear", "triton", "moeserve.ops.linear_triton:TritonLinear",
                    Requirements(cuda=True, min_capability=(8, 0), packages=("triton",), quantization=("none",),
                                 dtypes=_HALF),
                    "moeserve's Triton GEMV for steps of at most linear_gemv_max_tokens tokens (default 1), the LM "
                    "head included; cuBLAS above"),
        BackendSpec("linear", "torch", "moeserve.ops.linear:TorchLinear", Requirements(),
                    "torch matmul (cuBLAS on GPU)"),
    ],
    "sampling": [
        BackendSpec("sampling", "flashinfer", "moeserve.ops.sampling:FlashInferSampler",
                    Requirements(cuda=True, min_capability=(7, 5), packages=_FI),
                    "FlashInfer sorting-free top-k/top-p/min-p sampling", "moeserve.ops.sampling:flashinfer_modules"),
        BackendSpec("sampling", "torch", "moeserve.ops.sampling:TorchSampler", Requirements(),
                    "torch sort-based sampling"),
    ],
    "norm": [
        BackendSpec("norm", "flashinfer", "moeserve.ops.basic:FlashInferNorm", _GPU, "FlashInfer RMSNorm, fused add",
                    "moeserve.ops.basic:norm_modules"),
        BackendSpec("norm", "torch", "moeserve.ops.basic:TorchNorm", Requirements(), "torch RMSNorm"),
    ],
    "rope": [
        BackendSpec("rope", "flashinfer", "moeserve.ops.basic:FlashInferRope", _GPU, "FlashInfer RoPE with cos/sin cache",
                    "moeserve.ops.basic:rope_modules"),
        BackendSpec("rope", "torch", "moeserve.ops.basic:TorchRope", Requirements(), "torch RoPE"),
    ],
    "activation": [
        BackendSpec("activation", "flashinfer", "moeserve.ops.basic:FlashInferActivation", _GPU,
                    "FlashInfer silu_and_mul", "moeserve.ops.basic:activation_modules"),
        BackendSpec("activation", "torch", "moeserve.ops.basic:TorchActivation", Requirements(), "torch SiLU and mul"),
    ],
}

OPERATORS: tuple[str, ...] = tuple(SPECS)
BACKEND_NAMES: dict[str, tuple[str, ...]] = {op: tuple(s.name for s in specs) for op, specs in SPECS.items()}


class BackendUnavailable(RuntimeError):
    pass


def _installed(pkg: str) -> bool:
    return importlib.util.find_spec(pkg) is not None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check(spec: BackendSpec, hw: HardwareInfo, device: torch.device, dtype: torch.dtype,
          quantization: str = "none", head_dim: int | None = None) -> str | None:
    """None when ``spec`` can run here (for a model of this ``head_dim``, when given), else why not."""
    n = spec.needs
    if n.head_dims is not None and head_dim is not None and head_dim not in n.head_dims:
        return f"serves head_dim {', '.join(map(str, n.head_dims))}; the model's is {head_dim}"
    if n.quantization is not None and quantization not in n.quantization:
        return f"serves only {'/'.join(n.quantization)} weights (quantization is {quantization})"
    if n.cuda:
        if device.type != "cuda":
            return "needs a CUDA GPU" + ("" if hw.gpu else "; this machine has none")
        cc = hw.gpus[device.index or 0].capability
        if n.capabilities is not None and cc not in n.capabilities:
            return f"not on this GPU: needs {', '.join(_sm(c) for c in n.capabilities)}; this GPU is {_sm(cc)}"
        if n.min_capability is not None and cc < n.min_capability:
            return f"not on this GPU: needs {_sm(n.min_capability)} or newer; this GPU is {_sm(cc)}"
        if _dtype_name(dtype) == "bfloat16" and cc < n.bf16_min_capability:
            return f"not on this GPU: bfloat16 needs {_sm(n.bf16_min_capability)}; this GPU is {_sm(cc)}"
    if n.dtypes is not None and _dtype_name(dtype) not in n.dtypes:
        return f"serves only {'/'.join(n.dtypes)}, not {_dtype_name(dtype)}"
    missing = [p for p in n.packages if not _installed(p)]
    if missing:
        return f"not installed: {', '.join(missing)}"
    return None


def resolve(op: str, requested: str, hw: HardwareInfo, device: torch.device, dtype: torch.dtype,
            quantization: str = "none", head_dim: int | None = None) -> BackendSpec:
    specs = SPECS[op]
    if requested == "auto":
        reasons = []
        for spec in specs:
            why = check(spec, hw, device, dtype, quantization, head_dim)
            if why is None:
                return spec
            reasons.append(f"{spec.name}: {why}")
        raise BackendUnavailable(f"no {op} backend can run here ({'; '.join(reasons)})")
    for spec in specs:
        if spec.name == requested:
            why = check(spec, hw, device, dtype, quantization, head_dim)
            if why is not None:
                raise BackendUnavailable(f"backends.{op}: {requested!r} is not available: {why}")
            return spec
    raise BackendUnavailable(f"backends.{op}: unknown backend {requested!r}; choose one of "
                             f"auto, {', '.join(s.name for s in specs)}")


def load_target(target: str):
    """The object a ``"module:attribute"`` string names (importing the module)."""
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def load(spec: BackendSpec):
    """The backend class of ``spec``."""
    return load_target(spec.target)


def availability_matrix(hw: HardwareInfo, device: torch.device, dtype: torch.dtype,
                        quantization: str = "none") -> list[dict]:
    """One row per (operator, backend): available / why not; ``auto`` marks the one auto would take."""
    rows = []
    for op in OPERATORS:
        picked = None
        for spec in SPECS[op]:
            why = check(spec, hw, device, dtype, quantization)
            if why is None and picked is None:
                picked = spec.name
            rows.append({"operator": op, "backend": spec.name, "available": why is None,
                         "status": "available" if why is None else why, "auto": picked == spec.name and why is None,
                         "description": spec.description})
    return rows
