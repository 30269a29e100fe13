"""The MoE combine as one Triton kernel: ``out[t] = sum_j down[t*k + j] (+ sigmoid(g_t) * shared[t])``.

One program per (token, column block); the top-k rows of a token are read in one unrolled loop and summed
in float32 with the shared expert's gated output, then rounded once to the output dtype. No host
synchronisation, so it is captured in CUDA graphs with the rest of the step.

``moe_combine_add_norm_kernel`` also finishes the layer (``moe_fuse_norm``): one program per token adds the
rounded sum to the residual (in place) and writes the RMS norm of the result times the next norm's weight,
the arithmetic of FlashInfer's ``fused_add_rmsnorm`` after the combine, in one launch instead of two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.pdl import launch_kwargs
from moeserve.ops.pdl_triton import wait_prior

MAX_BLOCK = 1024
MAX_NORM_HIDDEN = 16384  # the fused norm holds a whole row in one program


@triton.jit
def _combined(down_ptr, shared_ptr, gate_ptr, t, cols, mask, stride_down, stride_shared, stride_gate,
              TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr):
    """Token ``t``'s columns ``cols``: the sum of its top-k rows plus the (gated) shared expert's, in float32."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(down_ptr + (t * TOP_K + j) * stride_down + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        s = tl.load(shared_ptr + t * stride_shared + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            g = tl.load(gate_ptr + t * stride_gate).to(tl.float32)
            s = tl.div_rn(s, 1.0 + tl.exp(-g))  # correctly rounded: no kernel fuses it into the add after it
        acc += s
    return acc


@triton.jit
def moe_combine_kernel(down_ptr, shared_ptr, gate_ptr, out_ptr, H, stride_down, stride_shared, stride_gate,
                       stride_out, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = _combined(down_ptr, shared_ptr, gate_ptr, t, cols, mask, stride_down, stride_shared, stride_gate, TOP_K,
                    HAS_SHARED, HAS_GATE, BLOCK)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def moe_combine_add_norm_kernel(down_ptr, shared_ptr, gate_ptr, res_ptr, w_ptr, out_ptr, H, eps, stride_down,
                                stride_shared, stride_gate, stride_res, stride_out, TOP_K: tl.constexpr,
                                HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr,
                                PDL: tl.constexpr = False):
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # before the wait: no kernel of a step writes it
    wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    acc = _combined(down_ptr, shared_ptr, gate_ptr, t, cols, mask, stride_down, stride_shared, stride_gate, TOP_K,
                    HAS_SHARED, HAS_GATE, BLOCK)
    _add_norm_store(acc, res_ptr + t * stride_res, w, out_ptr + t * stride_out, cols, mask, H, eps)


@triton.jit
def _add_norm_store(acc, res_ptr, w, out_ptr, cols, mask, H, eps):
    """A row's MoE sum ``acc`` (float32) rounded as the unfused combine stores it, then FlashInfer's
    ``fused_add_rmsnorm``: ``res += it`` (in place), ``out = rmsnorm(res) * w`` (``w`` float32, loaded)."""
    dtype = out_ptr.dtype.element_ty
    x = acc.to(dtype).to(tl.float32) + tl.load(res_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(res_ptr + cols, x.to(dtype), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(out_ptr + cols, (x * rstd * w).to(dtype), mask=mask)


@triton.jit
def combine_one_row(down_ptr, out_ptr, res_ptr, w_ptr, H, eps, stride_down, TOP_K: tl.constexpr,
                    ADD_NORM: tl.constexpr, BLOCK: tl.constexpr):
    """One token's combine by one program, as :func:`moe_combine_kernel` (no shared expert) or, with ``ADD_NORM``,
    :func:`moe_combine_add_norm_kernel` computes it: the sum of ``down``'s ``TOP_K`` rows into ``out`` ``[H]``, or
    that sum added to ``res`` (in place) and ``out`` the RMS norm of the result times ``w``. ``BLOCK``: ``H``
    rounded up to a power of two (the whole row at once). The last program of the MoE's down GEMM runs it
    (``triton_kernels.fused_moe_kernel``'s ``COMBINE``)."""
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    acc = _combined(down_ptr, down_ptr, down_ptr, 0, cols, mask, stride_down, 0, 0, TOP_K, False, False, BLOCK)
    if ADD_NORM:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        _add_norm_store(acc, res_ptr, w, out_ptr, cols, mask, H, eps)
    else:
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_combine_triton(down: torch.Tensor, top_k: int, shared: torch.Tensor | None = None,
                       gate_logit: torch.Tensor | None = None, out: torch.Tensor | None = None,
                       add_norm=None) -> torch.Tensor:
    """``down`` ``[T*k, H]`` -> ``[T, H]``; ``shared`` ``[T, H]`` is added (times ``sigmoid(gate_logit)``
    ``[T, 1]`` when given). The caller makes sure ``shared`` is ready on the current stream. ``add_norm``
    (``moeserve.ops.moe.combine.AddNorm``): the sum is added to its residual in place and the RMS norm of the
    new residual times its weight is returned instead."""
    rows, h = down.shape
    t = rows // top_k
    if out is None:
        out = torch.empty((t, h), dtype=down.dtype, device=down.device)
    if t == 0:
        return out
    if down.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("moe_combine: down and out must have contiguous rows")
    s_out, g = shared, gate_logit
    if s_out is not None and s_out.stride(1) != 1:
        s_out = s_out.contiguous()
    if add_norm is not None:
        res = add_norm.residual
        if res.stride(1) != 1 or h > MAX_NORM_HIDDEN:
            raise ValueError(f"moe_combine: the fused norm needs a residual with contiguous rows and a hidden size "
                             f"of at most {MAX_NORM_HIDDEN}")
        moe_combine_add_norm_kernel[(t,)](
            down, s_out if s_out is not None else down, g if g is not None else down, res, add_norm.weight, out, h,
            float(add_norm.eps), down.stride(0), s_out.stride(0) if s_out is not None else 0,
            g.stride(0) if g is not None else 0, res.stride(0), out.stride(0), TOP_K=top_k,
            HAS_SHARED=s_out is not None, HAS_GATE=g is not None, BLOCK=triton.next_power_of_2(h),
            num_warps=8 if h > 4096 else 4, **launch_kwargs(t))
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(h))
    grid = (t, triton.cdiv(h, block))
    moe_combine_kernel[grid](down, s_out if s_out is not None else down, g if g is not None else down, out, h,
                             down.stride(0), s_out.stride(0) if s_out is not None else 0,
                             g.stride(0) if g is not None else 0, out.stride(0), TOP_K=top_k,
                             HAS_SHARED=s_out is not None, HAS_GATE=g is not None, BLOCK=block, num_warps=4,
                             **launch_kwargs(t))
    return out
