"""Asking the L2 cache for weights ahead of the kernel that reads them (compute capability 9.0 and later:
``cp.async.bulk.prefetch.L2``, which fetches without returning data to the SM and without anything waiting for it).

A one-token decode step reads ~177 MB of weights a layer, but not evenly: the attention half (QKV GEMV, attention,
output projection) is a chain of kernels too small or too dependent to keep the memory busy, while the MoE
phase's end runs the shared expert's down projection alone. Two uses, each behind a switch:

- the GEMV (``moeserve.ops.linear_triton``, ``linear_gemv_prefetch``): launched with PDL, each program asks for
  its weight rows before it waits for the kernel before it, so the weights stream in while that kernel runs
  (the output projection's during the attention kernel);
- :func:`prefetch_l2` (``prefetch_next_qkv_max_tokens``): once the routed experts of a MoE layer are done and
  the main stream would wait for the shared expert's stream, it asks for the next layer's QKV weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.pdl import launch_kwargs
from moeserve.ops.pdl_triton import wait_prior

CHUNK = 16384  # bytes one lane asks for
LANES = 32  # lanes (threads) of one prefetch program: one warp


@triton.jit
def bulk_prefetch_l2(ptrs, sizes, live):
    """Where ``live``: ask L2 for ``sizes`` bytes (a multiple of 16) at ``ptrs`` (16-byte aligned)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptrs, sizes, live.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows_l2(base_ptr, first_row, n_rows, stride_row, row_bytes, ROWS: tl.constexpr, LANES: tl.constexpr):
    """Ask L2 for rows ``first_row`` up to ``first_row + ROWS`` (and below ``n_rows``) of a row-major matrix,
    ``stride_row`` elements apart, ``row_bytes`` bytes each (a multiple of 16, from a 16-byte aligned address).
    ``LANES``: the program's thread count; lane ``i`` asks for row ``first_row + i``, for ``i < ROWS``."""
    lane = tl.arange(0, LANES)
    row = first_row + lane
    live = (lane < ROWS) & (row < n_rows)
    ptrs = base_ptr + tl.where(live, row, 0).to(tl.int64) * stride_row
    bulk_prefetch_l2(ptrs, tl.full([LANES], row_bytes, tl.int32), live)


@triton.jit
def _prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, PDL: tl.constexpr = False):
    """Lane ``i`` of program ``p`` asks for bytes ``[(p * LANES + i) * CHUNK, + CHUNK)`` of ``nbytes``; then (with
    ``PDL``) the program waits for the kernel before it, so that the kernel after it still sees every kernel
    before it complete."""
    off = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    live = off < nbytes
    size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)
    bulk_prefetch_l2(ptr + tl.where(live, off, 0), size, live)
    wait_prior(PDL)


def can_prefetch(t: torch.Tensor) -> bool:
    """Whether :func:`prefetch_l2` takes ``t``: contiguous, on a CUDA GPU of compute capability 9.0 or later (or
    ``meta``, as ``moeserve precompile`` launches it), 16-byte aligned and a multiple of 16 bytes long."""
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 16 or t.data_ptr() % 16:
        return False
    if t.device.type == "meta":
        return True
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (9, 0)


def prefetch_l2(t: torch.Tensor, tokens: int) -> None:
    """Launch, on the current stream, a kernel that asks L2 for all of ``t`` (see :func:`can_prefetch`; others are
    left alone) and returns: the reads land while later kernels run. ``tokens``: the step's, for PDL."""
    if not can_prefetch(t) or t.numel() == 0:
        return
    nbytes = t.numel() * t.element_size()
    grid = (triton.cdiv(nbytes, CHUNK * LANES),)
    _prefetch_kernel[grid](t.view(-1).view(torch.uint8), nbytes, CHUNK=CHUNK, LANES=LANES, num_warps=1,
                           **launch_kwargs(tokens))
