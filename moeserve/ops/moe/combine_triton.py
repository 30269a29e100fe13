"""The MoE combine as one Triton kernel: ``out[t] = sum_j down[t*k + j] (+ sigmoid(g_t) * shared[t])``.

One program per (token, column block); the top-k rows of a token are read in one unrolled loop and summed
in float32 with the shared expert's gated output, then rounded once to the output dtype. No host
synchronisation, so it is captured in CUDA graphs with the rest of the step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.pdl import launch_kwargs
from moeserve.ops.pdl_triton import wait_prior

MAX_BLOCK = 1024


@triton.jit
def moe_combine_kernel(down_ptr, shared_ptr, gate_ptr, out_ptr, H, stride_down, stride_shared, stride_gate,
                       stride_out, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_GATE: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(down_ptr + (t * TOP_K + j) * stride_down + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        s = tl.load(shared_ptr + t * stride_shared + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            g = tl.load(gate_ptr + t * stride_gate).to(tl.float32)
            s = s / (1.0 + tl.exp(-g))
        acc += s
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_combine_triton(down: torch.Tensor, top_k: int, shared: torch.Tensor | None = None,
                       gate_logit: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``down`` ``[T*k, H]`` -> ``[T, H]``; ``shared`` ``[T, H]`` is added (times ``sigmoid(gate_logit)``
    ``[T, 1]`` when given). The caller makes sure ``shared`` is ready on the current stream."""
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
    block = min(MAX_BLOCK, triton.next_power_of_2(h))
    grid = (t, triton.cdiv(h, block))
    moe_combine_kernel[grid](down, s_out if s_out is not None else down, g if g is not None else down, out, h,
                             down.stride(0), s_out.stride(0) if s_out is not None else 0,
                             g.stride(0) if g is not None else 0, out.stride(0), TOP_K=top_k,
                             HAS_SHARED=s_out is not None, HAS_GATE=g is not None, BLOCK=block, num_warps=4,
                             **launch_kwargs(t))
    return out
