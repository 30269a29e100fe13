"""A decode step's inputs into its CUDA graph's buffers in one launch.

Before a decode graph replays, its token ids and positions are copied into the buffers it was captured with, and
with asynchronous scheduling each request's token is the one the previous step sampled, still on the device: in
torch that is two copies and five small kernels (the index casts, the gather from the sampled tokens, its cast, the
scatter), each a launch the GPU waits for between two steps. :func:`feed_step_inputs` does it all in one program:
the ids and positions are copied, then the fed rows take their tokens from the previous step's. On an H200 decode
was 0.8% faster at c=1 and 0.4% at c=8 than with the seven launches (two rounds, docs/results/2026-12-04-h200-z3).
The same launch copies the step's index lists into the attention's fixed buffers (``copies``: the attention
backend's ``begin_graph`` hands them over instead of copying them itself), so that a replay of the one-kernel Triton
decode needs no other copy than the step's one host-to-device copy of its packed buffer.
The same launch can also copy the previous step's sampled tokens out (``tokens_out``: into pinned host memory,
which the program writes directly), where a copy queued after that step's graph started ~6 µs after it and took
1.6 µs on an H200 before this step's inputs could follow.
:func:`feed_step_inputs_reference` is the torch form (``moeserve.engine.graphs.FEED_KERNEL = False`` runs it).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

CHUNK = 64  # rows a pass of the program covers


COPIES = 3  # other int32 tensors a launch copies into a graph's buffers (the attention's fixed index buffers)
COPY_CHUNK = 1024  # entries a pass of the program copies of each of them (a step's page list runs to thousands)


@triton.jit
def _copy(src_ptr, dst_ptr, n, CHUNK: tl.constexpr):
    for start in range(0, n, CHUNK):
        i = start + tl.arange(0, CHUNK)
        m = i < n
        tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=m), mask=m)


# every index tensor is a slice of the step's packed buffer (any alignment), and the counts change every step
@triton.jit(do_not_specialize=["n", "n_fed", "n_a", "n_b", "n_c", "n_tok"],
            do_not_specialize_on_alignment=["ids_ptr", "pos_ptr", "dst_ptr", "src_ptr", "prev_ptr", "ids_out_ptr",
                                            "pos_out_ptr", "a_ptr", "a_out_ptr", "b_ptr", "b_out_ptr", "c_ptr",
                                            "c_out_ptr", "tok_ptr", "tok_out_ptr"])
def _feed_kernel(ids_ptr, pos_ptr, dst_ptr, src_ptr, prev_ptr, ids_out_ptr, pos_out_ptr, n, n_fed,
                 a_ptr, a_out_ptr, n_a, b_ptr, b_out_ptr, n_b, c_ptr, c_out_ptr, n_c, tok_ptr, tok_out_ptr, n_tok,
                 CHUNK: tl.constexpr, COPY_CHUNK: tl.constexpr):
    _copy(tok_ptr, tok_out_ptr, n_tok, CHUNK)  # the previous step's tokens out (host memory: stores, no wait)
    _copy(a_ptr, a_out_ptr, n_a, COPY_CHUNK)  # the other copies first: nothing below reads them
    _copy(b_ptr, b_out_ptr, n_b, COPY_CHUNK)
    _copy(c_ptr, c_out_ptr, n_c, COPY_CHUNK)
    for start in range(0, n, CHUNK):
        i = start + tl.arange(0, CHUNK)
        m = i < n
        tl.store(ids_out_ptr + i, tl.load(ids_ptr + i, mask=m), mask=m)
        tl.store(pos_out_ptr + i, tl.load(pos_ptr + i, mask=m), mask=m)
    tl.debug_barrier()  # the copied ids are written before the fed rows overwrite theirs
    for start in range(0, n_fed, CHUNK):
        j = start + tl.arange(0, CHUNK)
        m = j < n_fed
        dst = tl.load(dst_ptr + j, mask=m, other=0)
        src = tl.load(src_ptr + j, mask=m, other=0)
        tok = tl.load(prev_ptr + src, mask=m, other=0)
        tl.store(ids_out_ptr + dst, tok.to(ids_out_ptr.dtype.element_ty), mask=m)


_NO_TOKENS: dict[torch.device, torch.Tensor] = {}  # the prev argument of a step without fed rows


def _check(ids_out, pos_out, ids, pos, dst, src, prev, copies=(), tokens_out=None) -> int:
    n = ids.shape[0]
    if tokens_out is not None:
        a, b = tokens_out
        if a.dtype != b.dtype or a.dim() != 1 or b.dim() != 1 or a.shape[0] != b.shape[0]:
            raise ValueError(f"feed_step_inputs: tokens out: {tuple(a.shape)} {a.dtype} into {tuple(b.shape)} "
                             f"{b.dtype} (1-d, one dtype, as many)")
    if len(copies) > COPIES:
        raise ValueError(f"feed_step_inputs: {len(copies)} other copies, at most {COPIES}")
    for a, b in copies:
        if a.dtype != torch.int32 or b.dtype != torch.int32 or a.shape[0] > b.shape[0]:
            raise ValueError(f"feed_step_inputs: a copy of {a.shape[0]} {a.dtype} entries into {b.shape[0]} "
                             f"{b.dtype} (int32 into at least as many)")
    if ids_out.shape[0] != n or pos.shape[0] != n or pos_out.shape[0] != n:
        raise ValueError(f"feed_step_inputs: {n} ids into {ids_out.shape[0]}, {pos.shape[0]} positions into "
                         f"{pos_out.shape[0]}")
    fed = 0 if dst is None else dst.shape[0]
    if fed and (src is None or prev is None or src.shape[0] != fed):
        raise ValueError("feed_step_inputs: fed rows need src (one per dst) and the previous step's tokens")
    return fed


def feed_step_inputs(ids_out: torch.Tensor, pos_out: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
                     dst: torch.Tensor | None = None, src: torch.Tensor | None = None,
                     prev: torch.Tensor | None = None,
                     copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
                     tokens_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """``ids_out[:] = ids``, ``pos_out[:] = pos`` (``[T]`` int32 each), then ``ids_out[dst[j]] = prev[src[j]]`` for
    each fed row ``j`` (``dst``, ``src``: int32 ``[F]``, ``F <= T``, distinct ``dst``; ``prev``: the previous step's
    sampled tokens, int64). No fed rows: ``dst`` None or empty. ``copies``: up to :data:`COPIES` more ``(src,
    dst)`` pairs of 1-d int32 tensors, ``dst[:len(src)] = src`` (a decode graph's attention buffers).
    ``tokens_out``: ``(tokens, out)``, ``out[:] = tokens`` (1-d, one dtype; ``out`` may be pinned host memory). One
    launch of one program."""
    fed = _check(ids_out, pos_out, ids, pos, dst, src, prev, copies, tokens_out)
    n = ids.shape[0]
    if n == 0 and not copies and tokens_out is None:
        return
    if not fed:
        dst = src = ids
        prev = _NO_TOKENS.get(ids.device)
        if prev is None:
            prev = _NO_TOKENS[ids.device] = torch.zeros(1, dtype=torch.int64, device=ids.device)
    pairs = [(a, b, a.shape[0]) for a, b in copies] + [(ids, ids, 0)] * (COPIES - len(copies))
    tok, tok_out = tokens_out if tokens_out is not None else (prev, prev)
    _feed_kernel[(1,)](ids, pos, dst, src, prev, ids_out, pos_out, n, fed, *(x for p in pairs for x in p),
                       tok, tok_out, 0 if tokens_out is None else tok.shape[0],
                       CHUNK=CHUNK, COPY_CHUNK=COPY_CHUNK, num_warps=4)


def feed_step_inputs_reference(ids_out: torch.Tensor, pos_out: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
                               dst: torch.Tensor | None = None, src: torch.Tensor | None = None,
                               prev: torch.Tensor | None = None,
                               copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
                               tokens_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """:func:`feed_step_inputs` in torch (the copies, casts, gather and scatter it replaces)."""
    fed = _check(ids_out, pos_out, ids, pos, dst, src, prev, copies, tokens_out)
    if tokens_out is not None:
        tokens_out[1].copy_(tokens_out[0], non_blocking=True)
    for a, b in copies:
        b[:a.shape[0]].copy_(a)
    ids_out.copy_(ids)
    pos_out.copy_(pos)
    if fed:
        ids_out.index_copy_(0, dst.long(), prev.index_select(0, src.long()).to(ids_out.dtype))
