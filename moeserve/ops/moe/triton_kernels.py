"""Fused mixture-of-experts in Triton: token alignment, a grouped GEMM kernel in the style of vLLM's
``fused_moe_kernel``, and SiLU-and-mul, composed by :func:`fused_moe`.

With the experts' gate and up rows interleaved (``interleave_gate_up``: row ``2j`` gate ``j``, row ``2j + 1`` up
``j``; the Triton MoE backend lays them out so once the weights are loaded) the first GEMM writes the SwiGLU
activation itself: every column tile holds the gate and up columns of the same outputs, so the epilogue pairs
them, and the separate SiLU-and-mul launch and its round trip through memory go away.

Every launch here is free of host synchronisation, so :func:`fused_moe` can be captured in a CUDA graph
for a fixed number of tokens.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.pdl import launch_kwargs
from moeserve.ops.pdl_triton import let_next_start, wait_prior

from .combine import SharedExpertOutput, moe_combine
from .combine_triton import combine_one_row
from .triton_configs import get_config

__all__ = ["moe_align_block_size", "fused_moe", "fused_moe_warmup", "invoke_fused_moe_kernel", "interleave_gate_up"]

_META_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M")
_ALIGN_SINGLE_CHUNK_LIMIT = 1024
_ALIGN_MAX_CHUNKS = 64
_ALIGN_ONE_PASS_ELEMS = 16384  # one program's one-hot of the ids: 256 ids of 64 experts (Qwen1.5-MoE at 64 tokens)
# warps of the one-pass program: 4 up to this many one-hot entries, 8 above (H200, 60 experts, top-4, per launch:
# 4.0 against 4.1 us at 32 tokens, 8.5 against 6.1 us at 48; scripts/align_bench.py)
_ALIGN_ONE_PASS_FOUR_WARPS = 8192
PAIRWISE_BLOCK_M = 16  # a pair's row tile: one real row (tl.dot needs 16)


@triton.jit
def _expert_histogram(ids_ptr, start, stop, E, E_PAD: tl.constexpr, TILE: tl.constexpr):
    """Token count per expert over ``ids[start:stop]`` as an ``[E_PAD]`` int32 vector."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for off in range(start, stop, TILE):
        idx = off + tl.arange(0, TILE)
        e = tl.load(ids_ptr + idx, mask=idx < stop, other=-1).to(tl.int32)
        e = tl.where((e >= 0) & (e < E), e, -1)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    return counts


@triton.jit(do_not_specialize=["numel", "chunk"])
def _moe_count_kernel(ids_ptr, hist_ptr, numel, chunk, E, E_PAD: tl.constexpr, TILE: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Per-chunk expert histogram: ``hist[pid, e]`` = tokens of chunk ``pid`` routed to expert ``e``."""
    wait_prior(PDL)
    pid = tl.program_id(0)
    start = pid * chunk
    stop = tl.minimum(numel, start + chunk)
    counts = _expert_histogram(ids_ptr, start, stop, E, E_PAD, TILE)
    experts = tl.arange(0, E_PAD)
    tl.store(hist_ptr + pid * E + experts, counts, mask=experts < E)


@triton.jit
def _write_padding(sorted_ptr, ntpp_ptr, counts, padded, ends, total, numel, E, block_m, E_PAD: tl.constexpr,
                   BM_PAD: tl.constexpr, PAD_TILE: tl.constexpr):
    """Stores the padded total and the padding (``numel``) in every slot no token takes: each expert's last
    ``padded - count`` slots and all slots past the padded total (``BM_PAD``: ``block_m`` rounded up to a power
    of two)."""
    experts = tl.arange(0, E_PAD)
    tl.store(ntpp_ptr, total)
    tail = tl.arange(0, BM_PAD)[None, :]
    tl.store(sorted_ptr + (ends - padded + counts)[:, None] + tail, numel,
             mask=(experts[:, None] < E) & (tail < (padded - counts)[:, None]))
    for p0 in range(total, numel + E * (block_m - 1), PAD_TILE):
        slots = p0 + tl.arange(0, PAD_TILE)
        tl.store(sorted_ptr + slots, numel, mask=slots < numel + E * (block_m - 1))


@triton.jit
def _write_block_owners(expert_ids_ptr, ends, total, block_m, num_blocks, first, step, TILE: tl.constexpr):
    """``expert_ids[b]``: the expert whose padded range holds block ``b`` (``-1`` past the total), for blocks
    ``first, first + TILE, ..`` in strides of ``step``."""
    for b0 in range(first, num_blocks, step):
        blocks = b0 + tl.arange(0, TILE)
        start = blocks * block_m
        owner = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), axis=1)
        owner = tl.where(start < total, owner, -1)
        tl.store(expert_ids_ptr + blocks, owner, mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["numel", "block_m", "num_blocks"])
def _moe_align_one_pass_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, ntpp_ptr, numel, E, block_m, num_blocks,
                               N_PAD: tl.constexpr, E_PAD: tl.constexpr, TILE: tl.constexpr, BM_PAD: tl.constexpr,
                               PAD_TILE: tl.constexpr, PDL: tl.constexpr = False):
    """The whole alignment of a small routing (at most ``N_PAD`` ids) in one program and one pass: the ids'
    one-hot ``[N_PAD, E_PAD]`` gives the counts (its column sums) and each id's rank among its expert's (its
    column prefix sums), so an id's slot is ``start[e] + rank`` with no loop over the ids."""
    wait_prior(PDL)
    idx = tl.arange(0, N_PAD)
    experts = tl.arange(0, E_PAD)
    e = tl.load(ids_ptr + idx, mask=idx < numel, other=-1).to(tl.int32)
    e = tl.where((e >= 0) & (e < E), e, -1)
    onehot = (e[:, None] == experts[None, :]).to(tl.int32)
    counts = tl.sum(onehot, axis=0)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    before = tl.cumsum(onehot, axis=0) - onehot  # ids of the same expert before each id
    slot = tl.sum(onehot * ((ends - padded)[None, :] + before), axis=1)
    tl.store(sorted_ptr + slot, idx, mask=e >= 0)
    _write_padding(sorted_ptr, ntpp_ptr, counts, padded, ends, total, numel, E, block_m, E_PAD, BM_PAD, PAD_TILE)
    _write_block_owners(expert_ids_ptr, ends, total, block_m, num_blocks, 0, TILE, TILE)


@triton.jit(do_not_specialize=["numel", "chunk", "num_chunks", "block_m", "num_blocks"])
def _moe_align_kernel(ids_ptr, hist_ptr, sorted_ptr, expert_ids_ptr, ntpp_ptr, numel, chunk, num_chunks, E,
                      block_m, num_blocks, E_PAD: tl.constexpr, NC_PAD: tl.constexpr, TILE: tl.constexpr,
                      FUSED_COUNT: tl.constexpr, BM_PAD: tl.constexpr, PAD_TILE: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Scatter chunk ``pid`` of the flat routing into expert-sorted, block-padded order.

    Every program derives the padded per-expert layout from the histogram (or counts the whole routing
    itself when ``FUSED_COUNT``, which requires a single chunk), writes its share of the block-to-expert
    map, and places each of its tokens at ``start[e] + (tokens of e before it)``. Program 0 also writes the
    padding (:func:`_write_padding`), so ``sorted`` needs no fill beforehand.
    """
    wait_prior(PDL)
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    if FUSED_COUNT:
        counts = _expert_histogram(ids_ptr, 0, numel, E, E_PAD, TILE)
        before = tl.zeros([E_PAD], dtype=tl.int32)
    else:
        rows = tl.arange(0, NC_PAD)
        hist = tl.load(hist_ptr + rows[:, None] * E + experts[None, :],
                       mask=(rows[:, None] < num_chunks) & (experts[None, :] < E), other=0)
        counts = tl.sum(hist, axis=0)
        before = tl.sum(tl.where(rows[:, None] < pid, hist, 0), axis=0)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    if pid == 0:
        _write_padding(sorted_ptr, ntpp_ptr, counts, padded, ends, total, numel, E, block_m, E_PAD, BM_PAD,
                       PAD_TILE)
    _write_block_owners(expert_ids_ptr, ends, total, block_m, num_blocks, pid * TILE, num_chunks * TILE, TILE)

    base = ends - padded + before
    lower = tl.arange(0, TILE)[:, None] > tl.arange(0, TILE)[None, :]
    start = pid * chunk
    stop = tl.minimum(numel, start + chunk)
    for off in range(start, stop, TILE):
        idx = off + tl.arange(0, TILE)
        e = tl.load(ids_ptr + idx, mask=idx < stop, other=-1).to(tl.int32)
        e = tl.where((e >= 0) & (e < E), e, -1)
        onehot = e[:, None] == experts[None, :]
        pos = tl.sum(tl.where(onehot, base[None, :], 0), axis=1)
        rank = tl.sum(((e[:, None] == e[None, :]) & lower).to(tl.int32), axis=1)
        tl.store(sorted_ptr + pos + rank, idx, mask=e >= 0)
        base += tl.sum(onehot.to(tl.int32), axis=0)


def _one_pass_rows(numel: int) -> int:
    return max(16, triton.next_power_of_2(numel))


def _one_pass_warps(numel: int, e_pad: int) -> int:
    return 4 if _one_pass_rows(numel) * e_pad <= _ALIGN_ONE_PASS_FOUR_WARPS else 8


def align_plan(numel: int, num_experts: int) -> str:
    """How :func:`moe_align_block_size` aligns ``numel`` ids over ``num_experts`` experts: ``one-pass`` (one
    program holds the ids' whole one-hot, at most ``_ALIGN_ONE_PASS_ELEMS`` entries), ``single`` (one program
    loops over tiles of the ids, counting and scattering) or ``chunked`` (a count kernel, then a program per
    chunk)."""
    if _one_pass_rows(numel) * triton.next_power_of_2(max(num_experts, 2)) <= _ALIGN_ONE_PASS_ELEMS:
        return "one-pass"
    return "single" if numel <= _ALIGN_SINGLE_CHUNK_LIMIT else "chunked"


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the flat routing ``topk_ids.flatten()`` by expert, each expert padded to a multiple of ``block_m``.

    Returns ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``: ``sorted_token_ids`` is
    ``[numel + num_experts * (block_m - 1)]`` int32 of flat indices, padding set to ``numel``; ``expert_ids``
    is ``[len(sorted_token_ids) // block_m]`` int32, the expert of each block (``-1`` past the end);
    ``num_tokens_post_padded`` is a ``[1]`` int32 device tensor. No host synchronisation.
    """
    tokens = topk_ids.shape[0]  # the step's (for PDL)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    numel = ids.numel()
    device = ids.device
    max_padded = numel + num_experts * (block_m - 1)
    num_blocks = max_padded // block_m
    sorted_ids = torch.empty((max_padded,), dtype=torch.int32, device=device)  # padding: the align kernel's
    expert_ids = torch.empty((num_blocks,), dtype=torch.int32, device=device)
    ntpp = torch.empty((1,), dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(max(num_experts, 2))
    tile = max(16, min(64, 4096 // e_pad))
    plan = align_plan(numel, num_experts)
    if plan == "one-pass":
        _moe_align_one_pass_kernel[(1,)](ids, sorted_ids, expert_ids, ntpp, numel, num_experts, block_m, num_blocks,
                                         N_PAD=_one_pass_rows(numel), E_PAD=e_pad, TILE=tile,
                                         BM_PAD=triton.next_power_of_2(block_m), PAD_TILE=1024,
                                         num_warps=_one_pass_warps(numel, e_pad), **launch_kwargs(tokens))
        return sorted_ids, expert_ids, ntpp
    fused_count = plan == "single"
    if fused_count:
        chunk, num_chunks, hist = max(numel, 1), 1, ntpp
    else:
        chunk = triton.cdiv(triton.cdiv(numel, _ALIGN_MAX_CHUNKS), tile) * tile
        num_chunks = triton.cdiv(numel, chunk)
        hist = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=device)
        _moe_count_kernel[(num_chunks,)](ids, hist, numel, chunk, num_experts, E_PAD=e_pad, TILE=tile,
                                         num_warps=4, **launch_kwargs(tokens))
    _moe_align_kernel[(num_chunks,)](ids, hist, sorted_ids, expert_ids, ntpp, numel, chunk, num_chunks,
                                     num_experts, block_m, num_blocks, E_PAD=e_pad,
                                     NC_PAD=triton.next_power_of_2(num_chunks), TILE=tile,
                                     FUSED_COUNT=fused_count, BM_PAD=triton.next_power_of_2(block_m),
                                     PAD_TILE=1024, num_warps=4, **launch_kwargs(tokens))
    return sorted_ids, expert_ids, ntpp


@triton.jit
def program_tile(EM, N, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, GROUP_SIZE_M: tl.constexpr):
    """``(pid_m, pid_n)``: the output tile of this program, row tiles grouped by ``GROUP_SIZE_M`` for L2 reuse."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def tile_rows(sorted_token_ids_ptr, expert_ids_ptr, pid_m, num_valid_tokens, BLOCK_SIZE_M: tl.constexpr,
              PAIRWISE: tl.constexpr = False):
    """``(rows, real-row mask, expert)`` of row tile ``pid_m`` of the expert-sorted routing.

    ``PAIRWISE``: no sorted routing; tile ``pid_m`` is the one (token, expert) pair ``pid_m`` of the flat
    ``topk_ids`` (passed as ``expert_ids_ptr``), its row alone in the tile."""
    if PAIRWISE:
        offs_token = tl.where(tl.arange(0, BLOCK_SIZE_M) == 0, pid_m, num_valid_tokens).to(tl.int64)
    else:
        offs_token = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    token_mask = offs_token < num_valid_tokens
    off_expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    return offs_token, token_mask, off_expert


@triton.jit
def expert_tile_rows(topk_ids_ptr, pid_m, num_valid_tokens, BLOCK_SIZE_M: tl.constexpr, ROUTE_K: tl.constexpr,
                     ROUTE_K_PAD: tl.constexpr):
    """``(rows, expert, owner)`` of the tile of flat routing pair ``pid_m`` when every token's pairs fit one tile.

    Row ``r`` of the tile is token ``r``'s pair routed to the pair's expert (``num_valid_tokens`` where token
    ``r`` did not pick it), so the tile covers every token of that expert; ``owner`` is the first pair routed to
    it (``num_valid_tokens`` for a masked id): only the owner's tile runs, each expert read once per step."""
    off_expert = tl.load(topk_ids_ptr + pid_m).to(tl.int32)
    flat = tl.arange(0, BLOCK_SIZE_M)[:, None] * ROUTE_K + tl.arange(0, ROUTE_K_PAD)[None, :]
    valid = (tl.arange(0, ROUTE_K_PAD)[None, :] < ROUTE_K) & (flat < num_valid_tokens)
    ids = tl.load(topk_ids_ptr + flat, mask=valid, other=-1).to(tl.int32)
    match = valid & (ids == off_expert) & (off_expert >= 0)
    owner = tl.min(tl.min(tl.where(match, flat, num_valid_tokens), axis=1), axis=0)
    picked = tl.max(match.to(tl.int32), axis=1) > 0
    offs_token = tl.where(picked, tl.sum(tl.where(match, flat, 0), axis=1), num_valid_tokens).to(tl.int64)
    return offs_token, off_expert.to(tl.int64), owner


@triton.jit
def store_tile(acc, c_ptr, topk_weights_ptr, offs_token, token_mask, pid_n, N, stride_cm, stride_cn,
               BLOCK_SIZE_N: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr):
    """Write a float32 tile to its rows of ``C`` (scaled by the routed weights when asked), padding skipped."""
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0.0)
        acc = acc * w[:, None]
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=token_mask[:, None] & (offs_cn[None, :] < N))


@triton.jit
def tile_dot(a_ptrs, b_ptrs, token_mask, offs_k, K, stride_ak, stride_bk, BLOCK_SIZE_M: tl.constexpr,
             BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE_FP32: tl.constexpr,
             A_CACHE: tl.constexpr):
    """The main loop of an expert GEMM tile: ``A[rows, :K] @ B[expert, :K, cols]`` in float32, ``A``'s rows
    masked by ``token_mask``, ``A`` read with the cache modifier ``A_CACHE`` (``""``: the default)."""
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    return tile_dot_from(acc, a_ptrs, b_ptrs, token_mask, offs_k, K, stride_ak, stride_bk, BLOCK_SIZE_K, EVEN_K,
                         IEEE_FP32, A_CACHE)


@triton.jit
def tile_dot_from(acc, a_ptrs, b_ptrs, token_mask, offs_k, K, stride_ak, stride_bk, BLOCK_SIZE_K: tl.constexpr,
                  EVEN_K: tl.constexpr, IEEE_FP32: tl.constexpr, A_CACHE: tl.constexpr):
    """:func:`tile_dot` accumulating onto ``acc``."""
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        if EVEN_K:
            a_mask = token_mask[:, None]
        else:
            a_mask = token_mask[:, None] & (offs_k[None, :] < K - k * BLOCK_SIZE_K)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0, cache_modifier=A_CACHE)
        if EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_SIZE_K, other=0.0)
        if IEEE_FP32:
            acc = tl.dot(a, b, acc=acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc=acc)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    return acc


@triton.jit
def store_swiglu_tile(acc, c_ptr, topk_weights_ptr, offs_token, token_mask, pid_n, N, stride_cm, stride_cn,
                      BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr):
    """A tile over ``N`` interleaved gate/up columns stored as ``silu(gate) * up`` in a half-width tile of a ``C``
    with ``N // 2`` columns (each rounded to ``C``'s dtype first, as a separate activation kernel would read
    them)."""
    gate, up = tl.split(tl.reshape(acc.to(c_ptr.dtype.element_ty).to(tl.float32),
                                   (BLOCK_SIZE_M, BLOCK_SIZE_N // 2, 2)))
    store_tile(gate / (1.0 + tl.exp(-gate)) * up, c_ptr, topk_weights_ptr, offs_token, token_mask, pid_n, N // 2,
               stride_cm, stride_cn, BLOCK_SIZE_N // 2, MUL_ROUTED_WEIGHT)


@triton.jit(do_not_specialize=["EM", "num_valid_tokens", "top_k"])
def fused_moe_kernel(a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
                     num_tokens_post_padded_ptr, N, K, EM, num_valid_tokens, top_k,
                     stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                     BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                     GROUP_SIZE_M: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
                     IEEE_FP32: tl.constexpr, PAIRWISE: tl.constexpr = False, SILU_MUL: tl.constexpr = False,
                     PDL: tl.constexpr = False, ROUTE_K: tl.constexpr = 0, ROUTE_K_PAD: tl.constexpr = 1,
                     EARLY: tl.constexpr = 0, EARLY_EXPERT: tl.constexpr = 0, PRELOAD_B: tl.constexpr = False,
                     COMBINE: tl.constexpr = 0, ADD_NORM: tl.constexpr = False, BLOCK_H: tl.constexpr = 1,
                     fin_ptr=None, out_ptr=None, res_ptr=None, nw_ptr=None, eps=0.0):
    """Grouped GEMM ``C[s, :] = A[s // top_k, :] @ B[expert(s)]^T`` over expert-sorted rows ``s``.

    ``A`` is ``[*, K]``, ``B`` is ``[E, N, K]``, ``C`` is ``[num_valid_tokens, N]``. Rows come from
    ``sorted_token_ids`` in blocks of ``BLOCK_SIZE_M`` sharing one expert; padded rows
    (``>= num_valid_tokens``) are skipped. With ``MUL_ROUTED_WEIGHT`` each row is scaled by
    ``topk_weights[s]`` in fp32 before the cast to ``C``'s dtype. ``EM`` bounds the padded row count.
    ``PAIRWISE``: one tile per flat routing pair, ``expert_ids`` is the flat ``topk_ids`` (see ``tile_rows``);
    with ``ROUTE_K`` (the routing's top-k, the step's tokens at most ``BLOCK_SIZE_M``) the tile of a pair holds
    every token routed to its expert and runs only for the expert's first pair (see ``expert_tile_rows``).
    ``SILU_MUL``: ``B``'s ``N`` rows are interleaved gate/up pairs and ``C`` has ``N // 2`` columns: the tile's
    columns ``2j`` and ``2j + 1`` (each rounded to ``C``'s dtype first, as a separate activation kernel would
    read them) become ``silu(gate) * up`` in column ``j`` of a half-width tile.
    ``EARLY`` (one token, ``PAIRWISE`` without ``ROUTE_K``): the last ``EARLY`` pairs are the fixed experts
    ``EARLY_EXPERT ..`` (a fused shared expert's pieces, which every token picks); their tiles are the grid's first
    and, under PDL, run their main loop before waiting for the kernel before (the routing): they read only ``A``
    and their weights until then, and ``A`` is complete whenever this kernel can start (see :func:`fused_moe`).
    Their stores still wait.
    ``PRELOAD_B`` (``PAIRWISE`` without ``ROUTE_K`` or ``EARLY``): each tile reads its pair's expert (from L2) and its
    first weight tile before it waits for the kernel before, ``A`` after: the ids must be complete whenever this
    kernel can start (``routed_moe_triton``: its routed tiles let this kernel be scheduled only once they have seen
    the routing done).
    ``COMBINE`` (one token, ``PAIRWISE``, ``C`` ``[COMBINE, N]``): the last program to finish sums ``C``'s rows into
    ``out`` ``[N]`` as the combine kernel would (``combine_triton.combine_one_row``; with ``ADD_NORM`` also adds them
    to ``res`` and writes the RMS norm of the result times ``nw``), counted on the int32 ``fin`` (at zero, left at
    zero); ``BLOCK_H``: ``N`` rounded up to a power of two.
    """
    pid_m, pid_n = program_tile(EM, N, BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP_SIZE_M)
    if EARLY == 0 and not PRELOAD_B:
        wait_prior(PDL, LET_NEXT=False)
    if EARLY > 0:  # tiles 0 .. EARLY - 1: the fixed pairs (the last EARLY); then the routed pairs in order
        early = pid_m < EARLY
        if not early:
            wait_prior(PDL, LET_NEXT=False)
        pair = tl.where(early, num_valid_tokens - EARLY + pid_m, pid_m - EARLY)
        offs_token = tl.where(tl.arange(0, BLOCK_SIZE_M) == 0, pair, num_valid_tokens).to(tl.int64)
        token_mask = offs_token < num_valid_tokens
        routed = tl.load(expert_ids_ptr + pair, mask=not early, other=0)
        off_expert = tl.where(early, EARLY_EXPERT + pid_m, routed).to(tl.int64)
    elif PAIRWISE and ROUTE_K > 0:
        offs_token, off_expert, owner = expert_tile_rows(expert_ids_ptr, pid_m, num_valid_tokens, BLOCK_SIZE_M,
                                                         ROUTE_K, ROUTE_K_PAD)
        if owner != pid_m:
            return
        token_mask = offs_token < num_valid_tokens
    elif PRELOAD_B:  # one pair per tile, its expert read before the wait (from L2: see the docstring)
        offs_token = tl.where(tl.arange(0, BLOCK_SIZE_M) == 0, pid_m, num_valid_tokens).to(tl.int64)
        token_mask = offs_token < num_valid_tokens
        off_expert = tl.load(expert_ids_ptr + pid_m, cache_modifier=".cg").to(tl.int64)
    else:
        if not PAIRWISE:
            if pid_m * BLOCK_SIZE_M >= tl.load(num_tokens_post_padded_ptr):
                return
        offs_token, token_mask, off_expert = tile_rows(sorted_token_ids_ptr, expert_ids_ptr, pid_m,
                                                       num_valid_tokens, BLOCK_SIZE_M, PAIRWISE)

    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (offs_token[:, None] // top_k * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = b_ptr + off_expert * stride_be + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)

    # with EARLY, A is read before any wait: from L2 (.cg), where the kernel that wrote it left it
    A_CACHE: tl.constexpr = ".cg" if EARLY > 0 else ""
    if PRELOAD_B:  # the first K tile: its weights before the wait, A after it; tile_dot_from takes the rest
        if EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K, other=0.0)
        wait_prior(PDL, LET_NEXT=False)
        if EVEN_K:
            a = tl.load(a_ptrs, mask=token_mask[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=token_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        if IEEE_FP32:
            acc = tl.dot(a, b, acc=acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc=acc)
        acc = tile_dot_from(acc, a_ptrs + BLOCK_SIZE_K * stride_ak, b_ptrs + BLOCK_SIZE_K * stride_bk, token_mask,
                            offs_k, K - BLOCK_SIZE_K, stride_ak, stride_bk, BLOCK_SIZE_K, EVEN_K, IEEE_FP32, A_CACHE)
    else:
        acc = tile_dot(a_ptrs, b_ptrs, token_mask, offs_k, K, stride_ak, stride_bk, BLOCK_SIZE_M, BLOCK_SIZE_N,
                       BLOCK_SIZE_K, EVEN_K, IEEE_FP32, A_CACHE)
    if EARLY > 0:
        if early:
            wait_prior(PDL, LET_NEXT=False)
    let_next_start(PDL)

    if SILU_MUL:
        store_swiglu_tile(acc, c_ptr, topk_weights_ptr, offs_token, token_mask, pid_n, N, stride_cm, stride_cn,
                          BLOCK_SIZE_M, BLOCK_SIZE_N, MUL_ROUTED_WEIGHT)
    else:
        store_tile(acc, c_ptr, topk_weights_ptr, offs_token, token_mask, pid_n, N, stride_cm, stride_cn, BLOCK_SIZE_N,
                   MUL_ROUTED_WEIGHT)
    if COMBINE > 0:  # the last program to finish sums the rows (every program's stores are done before it counts)
        tl.debug_barrier()
        done = tl.atomic_add(fin_ptr, 1, sem="acq_rel")
        if done == tl.num_programs(0) - 1:
            tl.atomic_xchg(fin_ptr, 0)
            combine_one_row(c_ptr, out_ptr, res_ptr, nw_ptr, N, eps, stride_cm, COMBINE, ADD_NORM, BLOCK_H)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``out[r, :] = silu(x[r, :I]) * x[r, I:2I]``, computed in fp32."""
    wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def launch_params(config: dict, n: int, sorted_token_ids: torch.Tensor, max_padded_rows: int | None
                  ) -> tuple[dict, dict, int, tuple]:
    """``(tile meta-parameters, launch options, EM, grid)`` of a grouped-GEMM launch over ``sorted_token_ids``
    (``EM``: the padded row bound, at most ``max_padded_rows``) into ``n`` output columns."""
    meta = {k: int(config[k]) for k in _META_KEYS}
    opts = {"num_warps": int(config.get("num_warps", 4)), "num_stages": int(config.get("num_stages", 3))}
    em = sorted_token_ids.shape[0] if max_padded_rows is None else min(max_padded_rows, sorted_token_ids.shape[0])
    grid = (triton.cdiv(em, meta["BLOCK_SIZE_M"]) * triton.cdiv(n, meta["BLOCK_SIZE_N"]),)
    return meta, opts, em, grid


def invoke_fused_moe_kernel(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor | None,
                            sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                            num_tokens_post_padded: torch.Tensor, top_k: int, config: dict,
                            max_padded_rows: int | None = None, warmup: bool = False, pairwise: bool = False,
                            silu_mul: bool = False, tokens: int | None = None, route_k: int = 0, early: int = 0,
                            preload_b: bool = False, combine: dict | None = None):
    """Launch (or, with ``warmup``, only compile) :func:`fused_moe_kernel` for ``c = a[rows // top_k] @ b[e]^T``.

    ``c`` is ``[rows, N]`` with ``rows = len(topk_ids.flatten())``; ``topk_weights`` (flat fp32, ``[rows]``)
    enables routed-weight scaling. ``max_padded_rows`` is an upper bound on ``num_tokens_post_padded``
    that shrinks the grid (defaults to ``len(sorted_token_ids)``). ``pairwise``: ``expert_ids`` is the flat
    ``topk_ids`` and each (token, expert) pair is its own row tile (no alignment; ``sorted_token_ids`` and
    ``num_tokens_post_padded`` are not read); with ``route_k`` (the routing's top-k) the tile of an expert's
    first pair takes every token routed to that expert, the others none. ``silu_mul``: ``b`` holds interleaved
    gate/up rows (``interleave_gate_up``) and ``c`` ``[rows, N / 2]`` receives ``silu(gate) * up``. ``tokens``:
    the step's token count (default ``rows / top_k``), which decides whether it launches with PDL
    (``moeserve.ops.pdl``). ``early`` (``pairwise``, one token, no ``route_k``): the last ``early`` pairs are the
    last ``early`` experts of ``b``, whose tiles run first and start before the kernel before this one ends
    (``fused_moe_kernel``'s ``EARLY``). ``preload_b`` (``pairwise``, no ``route_k`` or ``early``): each tile loads its
    first weight tile before it waits for the kernel before (``PRELOAD_B``: the ids must be complete whenever this
    kernel can start). ``combine`` (one token, ``pairwise``): ``{"fin": int32 counter at zero, "out": [1, N],
    "add_norm": AddNorm or None}``, the kernel's last program sums ``c``'s rows into ``out`` (``COMBINE``).
    """
    num_valid, n = c.shape
    k = b.shape[2]
    if silu_mul:
        n *= 2
        if b.shape[1] != n:
            raise ValueError(f"silu_mul: b has {b.shape[1]} rows per expert, expected {n}")
    meta, opts, em, grid = launch_params(config, n, sorted_token_ids, max_padded_rows)
    route = {}
    if pairwise:
        meta["BLOCK_SIZE_M"] = PAIRWISE_BLOCK_M
        if route_k:
            meta["BLOCK_SIZE_M"] = max(PAIRWISE_BLOCK_M, triton.next_power_of_2(num_valid // route_k))
            route = {"ROUTE_K": route_k, "ROUTE_K_PAD": triton.next_power_of_2(route_k)}
        em = num_valid * meta["BLOCK_SIZE_M"]
        grid = (num_valid * triton.cdiv(n, meta["BLOCK_SIZE_N"]),)
    if early:
        if not pairwise or route_k or num_valid != top_k or not 0 < early <= top_k:
            raise ValueError(f"early={early}: one token's pairs only ({num_valid} rows, top-{top_k}, "
                             f"pairwise={pairwise}, route_k={route_k})")
        route.update(EARLY=early, EARLY_EXPERT=b.shape[0] - early)
    if preload_b:
        if not pairwise or route_k or early:
            raise ValueError("preload_b: pairwise tiles without route_k or early only")
        route["PRELOAD_B"] = True
    if combine is not None:
        if not pairwise or route_k or c.stride(1) != 1 or num_valid > 64:
            raise ValueError("combine: one token's pairwise tiles with contiguous rows only")
        an = combine.get("add_norm")
        route.update(COMBINE=num_valid, ADD_NORM=an is not None, BLOCK_H=triton.next_power_of_2(n),
                     fin_ptr=combine["fin"], out_ptr=combine["out"], res_ptr=an.residual if an else combine["out"],
                     nw_ptr=an.weight if an else combine["out"], eps=float(an.eps) if an else 0.0)
    mul_w = topk_weights is not None
    args = (a, b, c, topk_weights if mul_w else c, sorted_token_ids, expert_ids, num_tokens_post_padded, n, k,
            em, num_valid, top_k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
            c.stride(0), c.stride(1))
    kwargs = dict(meta, MUL_ROUTED_WEIGHT=mul_w, EVEN_K=k % meta["BLOCK_SIZE_K"] == 0,
                  IEEE_FP32=a.dtype == torch.float32, PAIRWISE=pairwise, SILU_MUL=silu_mul, **route, **opts,
                  **launch_kwargs(num_valid // top_k if tokens is None else tokens))
    if warmup:
        return fused_moe_kernel.warmup(*args, grid=grid, **kwargs)
    return fused_moe_kernel[grid](*args, **kwargs)


def interleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, H]`` gate rows then up rows -> rows ``2j`` gate ``j``, ``2j + 1`` up ``j`` (a new tensor)."""
    e, two_i, h = w13.shape
    return w13.view(e, 2, two_i // 2, h).transpose(1, 2).reshape(e, two_i, h)


def deinterleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`interleave_gate_up`."""
    e, two_i, h = w13.shape
    return w13.view(e, two_i // 2, 2, h).transpose(1, 2).reshape(e, two_i, h)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, tokens: int | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` of shape ``[R, 2I]``, returned as ``[R, I]`` in ``x.dtype``;
    ``tokens``: the step's token count (default ``R``), for PDL."""
    rows, two_i = x.shape
    inter = two_i // 2
    if out is None:
        out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](x, out, inter, x.stride(0), out.stride(0),
                                                                BLOCK=block, num_warps=4,
                                                                **launch_kwargs(rows if tokens is None else tokens))
    return out


def _check_inputs(x, w13, w2, topk_weights, topk_ids):
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"fused_moe supports bf16/fp16/fp32 activations, got {x.dtype}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"weights must match activations ({x.dtype}); got {w13.dtype}, {w2.dtype}")
    t, h = x.shape
    e, two_i, h13 = w13.shape
    if h13 != h or w2.shape != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"routing shape mismatch: ids {tuple(topk_ids.shape)}, weights {tuple(topk_weights.shape)}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: dict | None = None, out: torch.Tensor | None = None,
              shared: SharedExpertOutput | None = None, masked_ids: bool = False,
              pairwise_max_tokens: int = 0, interleaved: bool = False, add_norm=None,
              fixed_tail: int = 0) -> torch.Tensor:
    """Mixture-of-experts SwiGLU MLP: ``sum_j w[t,j] * w2[e] @ (silu(gate_e x_t) * up_e x_t)``, ``e = ids[t,j]``.

    ``x`` ``[T, H]``; ``w13`` ``[E, 2I, H]`` (gate rows ``[0, I)``, up rows ``[I, 2I)``); ``w2`` ``[E, H, I]``;
    ``topk_weights`` ``[T, k]`` fp32; ``topk_ids`` ``[T, k]`` int32/int64. Returns ``[T, H]`` in ``x.dtype``
    (written into ``out`` when given). ``config`` holds the Triton tile parameters; ``None`` selects one with
    :func:`get_config`. ``shared``: a shared expert's output, added (gated) in the combine. ``masked_ids``:
    ``topk_ids`` may hold -1 (experts of other ranks), which add nothing. GEMMs accumulate in fp32; no host
    synchronisation. Steps of at most ``pairwise_max_tokens`` tokens (and no masked ids) skip the alignment
    (one launch per layer): the grid has a row tile per (token, expert) pair; in a step of
    one token each tile is its pair's row, in a larger one the tile of each expert's first pair takes every
    token routed to that expert (the step's tokens fit one tile) and the others end at once, so each expert
    is still read once per step. ``interleaved``: ``w13``'s rows are
    interleaved gate/up pairs (:func:`interleave_gate_up`) and the first GEMM writes the activation itself.
    ``add_norm`` (``moeserve.ops.moe.combine.AddNorm``): the combine also adds the result to its residual and
    returns the RMS norm of that instead. ``fixed_tail``: the last ``fixed_tail`` columns of ``topk_ids`` are
    always the last ``fixed_tail`` experts (a fused shared expert's pieces), in order; in a one-token step without
    the alignment their tiles of the first GEMM run first and, launched with PDL, start before the routing is
    done. They read ``x`` before waiting for the kernel before this one, so ``x`` must be complete whenever this
    kernel can start: after ``SparseMoE.route``'s norm, router and routing kernels it is, as this kernel starts
    only once the routing kernel has, which starts only once every router program has passed its own wait for
    the norm that wrote ``x``.
    """
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0:
        if shared is not None:
            shared.join()
        return out
    if config is None:
        config, _ = get_config(t, e, inter, h, top_k, x.dtype)
    rows = t * top_k
    pairwise = t <= pairwise_max_tokens and not masked_ids
    route_k = top_k if pairwise and t > 1 else 0
    early = fixed_tail if pairwise and t == 1 else 0
    if pairwise:
        expert_ids = topk_ids.reshape(-1)
        sorted_ids = ntpp = expert_ids  # not read
        max_rows = None
    else:
        block_m = int(config["BLOCK_SIZE_M"])
        max_rows = rows + min(rows, e) * (block_m - 1)
        sorted_ids, expert_ids, ntpp = moe_align_block_size(topk_ids, block_m, e)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()

    if interleaved:
        act = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
        invoke_fused_moe_kernel(x, w13, act, None, sorted_ids, expert_ids, ntpp, top_k, config, max_rows,
                                pairwise=pairwise, silu_mul=True, tokens=t, route_k=route_k, early=early)
    else:
        gate_up = torch.empty((rows, two_i), dtype=x.dtype, device=x.device)
        invoke_fused_moe_kernel(x, w13, gate_up, None, sorted_ids, expert_ids, ntpp, top_k, config, max_rows,
                                pairwise=pairwise, tokens=t, route_k=route_k, early=early)
        act = silu_and_mul(gate_up, tokens=t)
    # rows of a masked id are never written: zero them for the combine's sum
    down = (torch.zeros if masked_ids else torch.empty)((rows, h), dtype=x.dtype, device=x.device)
    invoke_fused_moe_kernel(act, w2, down, weights, sorted_ids, expert_ids, ntpp, 1, config, max_rows,
                            pairwise=pairwise, tokens=t, route_k=route_k)
    return moe_combine(down, top_k, shared, out, add_norm)


def fused_moe_warmup(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, config: dict,
                     interleaved: bool = False):
    """Compile (without launching) both GEMM variants :func:`fused_moe` uses for these shapes and ``config``.

    Returns the two compiled kernels (``FutureKernel`` objects inside ``triton.AsyncCompileMode``).
    """
    t, h = x.shape
    e, two_i, _ = w13.shape
    rows = max(t * top_k, 1)
    dev = x.device
    sorted_ids = torch.zeros((rows,), dtype=torch.int32, device=dev)
    expert_ids = torch.zeros((1,), dtype=torch.int32, device=dev)
    ntpp = torch.zeros((1,), dtype=torch.int32, device=dev)
    weights = torch.zeros((rows,), dtype=torch.float32, device=dev)
    gate_up = torch.empty((rows, two_i // 2 if interleaved else two_i), dtype=x.dtype, device=dev)
    act = torch.empty((rows, two_i // 2), dtype=x.dtype, device=dev)
    down = torch.empty((rows, h), dtype=x.dtype, device=dev)
    k1 = invoke_fused_moe_kernel(x, w13, gate_up, None, sorted_ids, expert_ids, ntpp, top_k, config, warmup=True,
                                 silu_mul=interleaved, tokens=t)
    k2 = invoke_fused_moe_kernel(act, w2, down, weights, sorted_ids, expert_ids, ntpp, 1, config, warmup=True,
                                 tokens=t)
    return k1, k2
