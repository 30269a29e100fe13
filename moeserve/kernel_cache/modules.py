"""FlashInfer JIT modules as plain data: what a backend loads for a given model and GPU target.

Each backend that loads FlashInfer modules names a function (``BackendSpec.flashinfer_modules`` in
``moeserve.backends``) that lists them for one ``Target`` (the model's shapes, the dtype, the architecture).
Each module is a ``KernelModule``: a FlashInfer generator (``flashinfer.jit....:gen_*``) and the arguments the
backend calls it with, as plain data, so that a subprocess with FlashInfer's environment set can rebuild the
``JitSpec``. Torch dtypes are written as strings ``"torch.bfloat16"``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from moeserve.kernel_cache.layout import Arch

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


def make_spec(module: KernelModule | dict):
    """The FlashInfer ``JitSpec`` a module describes (imports FlashInfer's JIT generators)."""
    import importlib
    m = module.to_json() if isinstance(module, KernelModule) else module
    mod_name, fn_name = m["gen"].split(":")
    fn = getattr(importlib.import_module(mod_name), fn_name)
    args = [getattr(torch, a.removeprefix("torch.")) if isinstance(a, str) and a.startswith("torch.") else a
            for a in m.get("args", ())]
    return fn(*args)


def short_dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(dtype, str(dtype).removeprefix("torch."))
