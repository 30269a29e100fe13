"""Dense linear layers: torch (cuBLAS on GPU, the reference everywhere) and FlashInfer's SM90 block-FP8 GEMM.

Every backend has ``linear(x, weight, bias)`` for high-precision weights and ``linear_fp8(x, weight,
weight_scale, bias)`` for e4m3 weights with 128x128 block scales (``weight_scale`` float32
``[ceil(N/128), ceil(K/128)]``). The FP8 reference quantises the activations 1x128 per token and
dequantises the weight blocks, then multiplies in float32 (``moeserve.quant.fp8.fp8_linear_reference``): it
computes what the FP8 kernels compute (W8A8 with the same activation groups), so a fast path differs from
it only by accumulation order, and its distance to the high-precision model is the real FP8 error.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from moeserve.ops.eager import eager
from moeserve.ops.interfaces import LinearBackend
from moeserve.quant.fp8 import BLOCK, block_scale_shape, fp8_linear_reference

log = logging.getLogger("moeserve")


class TorchLinear(LinearBackend):
    name = "torch"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def linear_fp8(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear_reference(x, weight, weight_scale, bias)


def fp8_gemm_shape_ok(n: int, k: int, weight_scale_shape: tuple[int, ...]) -> str | None:
    """None when ``fp8_blockscale_gemm_sm90`` takes an ``[n, k]`` weight with these block scales, else why not."""
    if k % BLOCK:
        return f"K={k} is not a multiple of {BLOCK}"
    if n % 64:
        return f"N={n} is not a multiple of 64"
    if tuple(weight_scale_shape) != block_scale_shape(n, k):
        return f"weight scales {list(weight_scale_shape)} are not 128x128 blocks of [{n}, {k}]"
    return None


class FlashInferFp8Linear(LinearBackend):
    """``flashinfer.gemm.fp8_blockscale_gemm_sm90``: bf16 activations (quantised 1x128 inside the kernel) times
    e4m3 weights with 128x128 block scales, bf16 out. High-precision layers (router, gates) use torch.

    A layer whose shape the kernel does not take (K % 128, N % 64) runs the torch FP8 reference; each such
    shape is logged once as a warning.
    """

    name = "flashinfer"

    def __init__(self, device: torch.device, dtype: torch.dtype):
        if dtype != torch.bfloat16:
            raise ValueError(f"linear backend 'flashinfer' (fp8_blockscale_gemm_sm90) writes bfloat16 output; "
                             f"dtype is {str(dtype).removeprefix('torch.')}")
        from moeserve.kernel_cache import flashinfer_env  # noqa: F401  (before flashinfer: it sets its JIT env)
        from flashinfer.gemm import fp8_blockscale_gemm_sm90
        self._gemm = fp8_blockscale_gemm_sm90
        self.device = device
        self.fallback_shapes: set[tuple[int, int]] = set()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    @eager  # a custom kernel launch: torch.compile (torch_compile: true) runs it eagerly
    def linear_fp8(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = weight.shape
        why = fp8_gemm_shape_ok(n, k, tuple(weight_scale.shape))
        if why is not None:
            if (n, k) not in self.fallback_shapes:
                self.fallback_shapes.add((n, k))
                log.warning("linear 'flashinfer': FP8 weight [%d, %d] runs the torch FP8 reference (%s)", n, k, why)
            return fp8_linear_reference(x, weight, weight_scale, bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if x2.shape[0] == 0:
            return x.new_empty((*lead, n))
        out = self._gemm(x2.to(torch.bfloat16).contiguous(), weight, None, weight_scale, out_dtype=torch.bfloat16)
        if bias is not None:
            out = out + bias
        return out.to(x.dtype).reshape(*lead, n)


def flashinfer_modules(t) -> list:
    """The SM90 FP8 block-scale GEMM behind the FP8 linear backend (``t``: a ``kernel_cache.modules.Target``)."""
    from moeserve.kernel_cache.modules import KernelModule
    if t.arch.major != 9:
        return []
    return [KernelModule("fp8_gemm", "linear", "flashinfer", "FP8 block-scale GEMM (sm90)",
                         "flashinfer.jit.gemm.fp8_blockscale:gen_fp8_blockscale_gemm_sm90_module", (False,), weight=70)]
