"""Residual add + RMSNorm for small steps in Triton, launched with programmatic dependent launch so that the kernel
after it can be placed on the GPU while it runs (FlashInfer's ``fused_add_rmsnorm`` lets its successor start only
at its very end: ``griddepcontrol.launch_dependents`` is its last instruction). Steps of at most
``norm_triton_max_tokens`` (default 64) run it through ``moeserve.ops.basic.FlashInferNorm``: on an H200 decode was
3.3% faster at c=1, 1.1% at c=8 and 0.6% at c=32 than with FlashInfer's kernel (docs/results/2026-12-04-h200-z).

:func:`embed_rmsnorm` is a step's first kernel for such steps: the token embedding's rows and the first layer's
input norm of them in one launch, where ``F.embedding`` and FlashInfer's ``rmsnorm`` were two, neither under PDL."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.pdl import launch_kwargs
from moeserve.ops.pdl_triton import wait_prior

MAX_HIDDEN = 16384  # one program holds a whole row


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, H, eps, stride_x, stride_res, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Row ``t``: ``res = x + res`` (rounded to the residual's dtype), ``x = res / rms(res) * w`` with the sum in
    float32, as FlashInfer's ``fused_add_rmsnorm`` computes it (the norm of the unrounded sum). The weight is read
    before the wait (nothing in a step writes it); the next kernel may start right after the wait."""
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(res_ptr + t * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(res_ptr + t * stride_res + cols, x.to(res_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(x_ptr + t * stride_x + cols, (x * rstd * w).to(x_ptr.dtype.element_ty), mask=mask)


def takes(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether :func:`add_rmsnorm` takes these ``[T, H]`` tensors: rows of at most :data:`MAX_HIDDEN` contiguous
    elements."""
    return x.shape[1] <= MAX_HIDDEN and x.stride(1) == 1 and residual.stride(1) == 1


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, as FlashInfer's ``fused_add_rmsnorm``: ``residual += x``, then ``x = rmsnorm(residual) * weight``;
    returns ``(x, residual)``. ``x`` and ``residual`` ``[T, H]`` with contiguous rows, ``H`` at most
    :data:`MAX_HIDDEN`."""
    t, h = x.shape
    if not takes(x, residual):
        raise ValueError(f"add_rmsnorm: rows of at most {MAX_HIDDEN} contiguous elements, got {tuple(x.shape)}")
    if t:
        _add_rmsnorm_kernel[(t,)](x, residual, weight, h, float(eps), x.stride(0), residual.stride(0),
                                  BLOCK=triton.next_power_of_2(h), num_warps=8 if h > 4096 else 4,
                                  **launch_kwargs(t))
    return x, residual


@triton.jit
def _embed_rmsnorm_kernel(ids_ptr, table_ptr, w_ptr, out_ptr, res_ptr, H, eps, stride_table, stride_out, stride_res,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Row ``t``: ``res = table[ids[t]]``, ``out = res / rms(res) * w`` with the sum in float32, as FlashInfer's
    ``rmsnorm`` computes it. The weight is read before the wait; the ids (written before the step) after it."""
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    tok = tl.load(ids_ptr + t).to(tl.int64)
    x = tl.load(table_ptr + tok * stride_table + cols, mask=mask, other=0.0)
    tl.store(res_ptr + t * stride_res + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(out_ptr + t * stride_out + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def embed_rmsnorm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(table[ids]) * weight, table[ids])`` in one launch: ``ids`` ``[T]`` integer, ``table`` ``[V, H]`` with
    contiguous rows, ``H`` at most :data:`MAX_HIDDEN`. The ids must index rows of the table (as ``F.embedding``'s)."""
    t = ids.shape[0]
    h = table.shape[1]
    if ids.dim() != 1 or table.dim() != 2 or h > MAX_HIDDEN or table.stride(1) != 1:
        raise ValueError(f"embed_rmsnorm: [T] ids into a [V, H] table of contiguous rows of at most {MAX_HIDDEN}, "
                         f"got {tuple(ids.shape)} and {tuple(table.shape)}")
    out = torch.empty(t, h, dtype=table.dtype, device=table.device)
    res = torch.empty_like(out)
    if t:
        _embed_rmsnorm_kernel[(t,)](ids, table, weight, out, res, h, float(eps), table.stride(0), out.stride(0),
                                    res.stride(0), BLOCK=triton.next_power_of_2(h), num_warps=8 if h > 4096 else 4,
                                    **launch_kwargs(t))
    return out, res
