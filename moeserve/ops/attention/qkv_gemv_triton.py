"""A one-token decode step's QKV projection and its decode attention in one grid (``QKV_IN_GRID``, an A/B switch,
off: not yet measured on a GPU).

Apart, the attention (``moeserve.ops.attention.decode_triton``) is launched under PDL once every program of the QKV
GEMV has started, loads its keys, and waits until the whole GEMV grid has completed; on an H200 it ended 6.5 µs
after the GEMV did (docs/results/2026-12-04-h200-z5). Here one grid holds both:

- programs ``0 .. NG - 1`` are the GEMV's (``BLOCK_N`` rows of the ``[(Hq + 2 Hkv) * D, K]`` weight each, the
  bias added, written to ``qkv``): each waits for the kernel before it (PDL), and once its rows are written adds
  one to the counter of the kv head they belong to (q rows count for their group's kv head);
- the next ``Hkv * splits`` programs are the attention's splits: each loads its range and first keys as the kernel
  apart does, then waits (atomic reads) until its kv head's counter holds every GEMV program of that head's q, k
  and v rows, and only then lets the next kernel be scheduled; the rest is ``qkv_decode_attention_kernel``'s, the
  projection read back with ``.cg`` loads (other programs wrote it). The program that merges a head's splits (or
  the head's one program) resets its counter.

So a head's attention starts as soon as its own rows are written, not after a grid-wide completion. The split
programs wait only on lower program ids, which the GPU dispatches first, and the GEMV's programs wait on nothing
of this grid; should the dispatch order ever not hold, a split gives up after ``SPIN_LIMIT`` reads and ends the
kernel with a trap (as ``moeserve.ops.moe.routed_moe_triton`` does). ``TILES``: the GEMV's form, ``"dot"``
(``linear_triton._gemv_kernel``'s ``tl.dot`` over a 16-row tile, its tiles for this weight) or ``"row"``
(``_gemv_row_kernel``'s elementwise rows, which read the QKV weight faster alone but in more programs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.attention import decode_kernel_takes_rotary
from moeserve.ops.attention.decode_triton import (LOG2E, MAX_SPLITS, ROWS_DONE_STRIDE, _attend_loaded_new,
                                                  _attend_split, _load_new, _merge_partials, _split_setup,
                                                  _store_partial, num_splits)
from moeserve.ops.attention.qkv_triton import _load_heads, _norm_rope, check_qkv_inputs
from moeserve.ops.linear_triton import _w_tile, _x_row, _xt_tile
from moeserve.ops.pdl import launch_kwargs
from moeserve.ops.pdl_triton import let_next_start, wait_prior

QKV_IN_GRID = False  # A/B switch: one-token Triton decode steps run the QKV GEMV and the attention in one grid
TILES = "dot"  # the GEMV's form in that grid: "dot" or "row" (an A/B knob)
DOT_TILES = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}  # linear_triton.gemv_config's for QKV
ROW_TILES = {"BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 3}  # gemv_row_config's
SPIN_LIMIT = 1 << 22  # reads of a counter before a split ends the kernel (each an L2 round trip)
# at most this many splits per kv head (None: decode_triton.num_splits's, 16 for Qwen1.5-MoE on an H200). At 155
# registers a thread and 4 warps three of the grid's programs fit an SM: 396 on an H200 for the GEMV's 192 and 16
# heads' 256 splits, so that the last 52 start only as GEMV programs end; 8 splits fit them all (an A/B knob)
MAX_SPLITS_IN_GRID = None
# ... or four programs an SM (an A/B knob): at most 128 registers a thread (ptxas spills 4 bytes in the "dot" form,
# none in "row") and at most three stages of the GEMV's loop (48 KiB of shared memory in the "dot" form): 528 on an
# H200, every program of the grid at once
FOUR_PER_SM = False
# the kernel's pipelining, which the attention's loop over its keys takes (decode_triton's launch: 2); the GEMV's loop
# takes its tiles' own (tl.range), so that the two loops' buffers together stay within an SM's shared memory
ATTENTION_STAGES = 2


@triton.jit
def _abort():
    """Ends the kernel with an error (PTX ``trap``): its launch, and the CUDA context, fail."""
    tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _rows_dot(x_ptr, w_ptr, b_ptr, p, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr):
    """Rows ``[p * BLOCK_N, (p + 1) * BLOCK_N)`` of ``w @ x (+ b)`` for one row ``x``, float32: ``tl.dot`` with x
    padded to 16 rows, as ``linear_triton._gemv_kernel`` computes them."""
    offs_n = p * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = (offs_n % N).to(tl.int64)
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < 1
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * 0 + offs_k[:, None]
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
        w = _w_tile(w_ptrs, offs_k, K - k * BLOCK_K, EVEN_K)
        xt = _xt_tile(x_ptrs, offs_k, m_mask, K - k * BLOCK_K, EVEN_K)
        acc = tl.dot(w, xt, acc=acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
    return tl.sum(tl.where(m_mask[None, :], acc, 0.0), axis=1)


@triton.jit
def _rows_elementwise(x_ptr, w_ptr, b_ptr, p, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr):
    """The same rows as :func:`_rows_dot`, the weight tiles multiplied elementwise in registers, as
    ``linear_triton._gemv_row_kernel`` computes them."""
    offs_n = p * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
        w = _w_tile(w_ptrs, offs_k, K - k * BLOCK_K, EVEN_K)
        x = _x_row(x_ptr + k * BLOCK_K + offs_k, offs_k, K - k * BLOCK_K, EVEN_K)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows_n).to(tl.float32)
    return y


# (index tensors are slices of one packed buffer; the split count and the spin limit are not specialised on)
@triton.jit(do_not_specialize=["nsplit", "spin_limit"],
            do_not_specialize_on_alignment=["pos_ptr", "kv_pos_ptr", "kv_indices_ptr", "kv_indptr_ptr"])
def qkv_gemv_attention_kernel(
        x_ptr, w_ptr, b_ptr, qkv_ptr, K, stride_wn,
        pos_ptr, cos_sin_ptr, out_ptr, cache_ptr, kv_pos_ptr, kv_indices_ptr, kv_indptr_ptr,
        q_norm_ptr, k_norm_ptr, part_o_ptr, part_ml_ptr, counter_ptr, rows_done_ptr,
        stride_cs, stride_page, stride_kv, stride_slot, stride_head, eps, scale_log2, nsplit, spin_limit,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, PAGE: tl.constexpr,
        G: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
        QK_NORM: tl.constexpr, BLOCK: tl.constexpr, SPLIT_PAD: tl.constexpr, G_MERGE: tl.constexpr,
        HAS_BIAS: tl.constexpr, ROW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, STAGES: tl.constexpr, STRIDE: tl.constexpr, PDL: tl.constexpr = False):
    N: tl.constexpr = (HQ + 2 * HKV) * D
    NG: tl.constexpr = N // BLOCK_N  # the GEMV's programs (BLOCK_N divides D)
    PER_HEAD: tl.constexpr = (G + 2) * (D // BLOCK_N)  # GEMV programs of one kv head's q, k and v rows
    pid = tl.program_id(0)
    if pid < NG:  # the GEMV's rows [pid * BLOCK_N, (pid + 1) * BLOCK_N)
        wait_prior(PDL)
        if ROW:
            y = _rows_elementwise(x_ptr, w_ptr, b_ptr, pid, N, K, stride_wn, HAS_BIAS, BLOCK_N, BLOCK_K, EVEN_K,
                                  STAGES)
        else:
            y = _rows_dot(x_ptr, w_ptr, b_ptr, pid, N, K, stride_wn, HAS_BIAS, BLOCK_N, BLOCK_K, EVEN_K, STAGES)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(qkv_ptr + offs_n, y.to(qkv_ptr.dtype.element_ty))
        tl.debug_barrier()  # every thread's rows are written before the counter moves
        r0 = pid * BLOCK_N
        kvh = tl.where(r0 < HQ * D, (r0 // D) // G, (r0 - HQ * D) // D % HKV)  # k rows, then v rows
        tl.atomic_add(rows_done_ptr + kvh * STRIDE, 1, sem="release")
    else:  # split s of kv head h
        u = pid - NG
        h = u // nsplit
        s = u % nsplit
        t = 0
        cdt = cache_ptr.dtype.element_ty
        dd = tl.arange(0, D_PAD)
        # before the wait, as the kernel apart: the range and the first block of cached keys and values
        cos, sin, kv_pos, first_page, start, end, stop, k1, k2, kr, v, nm = _split_setup(
            t, h, s, True, nsplit, pos_ptr, cos_sin_ptr, cache_ptr, kv_pos_ptr, kv_indices_ptr, kv_indptr_ptr,
            stride_cs, stride_page, stride_kv, stride_slot, stride_head, D, ROT, PAGE, D_PAD, HALF_PAD, REST_PAD,
            BLOCK)
        has_new = (start <= kv_pos) & (kv_pos < end)
        page_new = tl.load(kv_indices_ptr + first_page + kv_pos // PAGE).to(tl.int64)
        done = tl.atomic_add(rows_done_ptr + h * STRIDE, 0, sem="acquire")
        spins = 0
        while done < PER_HEAD:
            spins += 1
            if spins > spin_limit:  # the GEMV's programs never came (see the module's docstring): fail, not hang
                _abort()
            done = tl.atomic_add(rows_done_ptr + h * STRIDE, 0, sem="acquire")
        let_next_start(PDL)
        src = qkv_ptr
        g = tl.arange(0, G_PAD)
        gm = g < G
        qh = h * G + g
        qx1, qx2, qxr = _load_heads(src, qh, gm, HALF_PAD, REST_PAD, D, ROT, ".cg")
        kx1, kx2, kxr, vn = _load_new(src, h, has_new, HQ, HKV, D, ROT, D_PAD, HALF_PAD, REST_PAD, ".cg")
        q1, q2, qr = _norm_rope(qx1, qx2, qxr, q_norm_ptr, cos, sin, eps, cdt, D, ROT, HALF_PAD, REST_PAD, QK_NORM)
        q1, q2, qr = q1.to(cdt), q2.to(cdt), qr.to(cdt)
        m_i, l_i, acc = _attend_split(q1, q2, qr, k1, k2, kr, v, nm, src, cos, sin, k_norm_ptr, eps, cache_ptr,
                                      kv_indices_ptr, first_page, kv_pos, start, stop, end, h, stride_page,
                                      stride_kv, stride_slot, stride_head, scale_log2, HQ, HKV, D, ROT, PAGE, G_PAD,
                                      D_PAD, HALF_PAD, REST_PAD, QK_NORM, BLOCK, ".cg", False)
        if has_new:
            m_i, l_i, acc = _attend_loaded_new(q1, q2, qr, kx1, kx2, kxr, vn, page_new, cos, sin, k_norm_ptr, eps,
                                               cache_ptr, kv_pos, h, stride_page, stride_kv, stride_slot,
                                               stride_head, scale_log2, m_i, l_i, acc, D, ROT, PAGE, D_PAD, HALF_PAD,
                                               REST_PAD, QK_NORM)
        out_rows = out_ptr + qh[:, None] * D + dd[None, :]
        omask = gm[:, None] & (dd[None, :] < D)
        if nsplit == 1:
            tl.store(out_rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(rows_done_ptr + h * STRIDE, 0)  # the head's one program: ready for the next launch
        else:
            _store_partial(part_o_ptr, part_ml_ptr, qh * nsplit + s, gm, m_i, l_i, acc, D, D_PAD)
            tl.debug_barrier()  # every thread's partial is written before the counter moves
            merged_by = tl.atomic_add(counter_ptr + h, 1, sem="acq_rel")
            if merged_by == nsplit - 1:  # the last split of h (every split is past its wait): merge, reset
                mg = tl.arange(0, G_MERGE)
                mgm = mg < G
                merged = _merge_partials(part_o_ptr, part_ml_ptr, h * G + mg, mgm, nsplit, D, D_PAD, SPLIT_PAD)
                mrows = out_ptr + (h * G + mg)[:, None] * D + dd[None, :]
                tl.store(mrows, merged.to(out_ptr.dtype.element_ty), mask=mgm[:, None] & (dd[None, :] < D))
                tl.atomic_xchg(counter_ptr + h, 0)
                tl.atomic_xchg(rows_done_ptr + h * STRIDE, 0)


def tiles() -> dict:
    """The GEMV's tiles in the grid, as :data:`TILES` says (at most three stages with :data:`FOUR_PER_SM`)."""
    c = {**(ROW_TILES if TILES == "row" else DOT_TILES), "row": TILES == "row"}
    if FOUR_PER_SM:
        c["num_stages"] = min(3, c["num_stages"])
    return c


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                       num_kv_heads: int, head_dim: int, cos_sin: torch.Tensor, workspace) -> str | None:
    """None when :func:`qkv_gemv_decode_attention` takes these inputs, else why not."""
    c = tiles()
    n = (num_heads + 2 * num_kv_heads) * head_dim
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1:
        return f"x {tuple(x.shape)} (one contiguous row only)"
    if weight.shape != (n, x.shape[1]) or not weight.is_contiguous():
        return f"weight {tuple(weight.shape)} is not a contiguous [{n}, {x.shape[1]}] QKV weight"
    if weight.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        return f"{weight.dtype} weight for {x.dtype} rows (bf16 or fp16, the same)"
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        return f"bias {tuple(bias.shape)} {bias.dtype}"
    if head_dim % c["BLOCK_N"]:
        return f"head_dim {head_dim} is not a multiple of the GEMV's {c['BLOCK_N']} rows a program"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads"
    if not decode_kernel_takes_rotary(head_dim, cos_sin.shape[1]):
        return f"rotary width {cos_sin.shape[1]} of head_dim {head_dim}"
    if workspace.rows_done.numel() < num_kv_heads * ROWS_DONE_STRIDE:
        return "the workspace has no counter for every kv head"
    return None


def qkv_gemv_decode_attention(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                              head_dim: int, cache: torch.Tensor, kv_positions: torch.Tensor,
                              kv_indices: torch.Tensor, kv_indptr: torch.Tensor, q_norm: torch.Tensor | None,
                              k_norm: torch.Tensor | None, eps: float, scale: float, workspace,
                              out: torch.Tensor | None = None, qkv: torch.Tensor | None = None,
                              spin_limit: int = SPIN_LIMIT) -> torch.Tensor:
    """``qkv_decode_attention(x @ weight^T + bias, ...)`` of a one-token decode step in one launch (the module's
    docstring): ``x`` ``[1, K]``, ``weight`` ``[(Hq + 2 Hkv) * D, K]``; the projection is left in ``qkv`` (a new
    ``[1, (Hq + 2 Hkv) * D]`` tensor when None), the output ``[1, Hq, D]`` returned (in ``out`` when given)."""
    why = unsupported_reason(x, weight, bias, num_heads, num_kv_heads, head_dim, cos_sin, workspace)
    if why is not None:
        raise ValueError(f"qkv_gemv_decode_attention: {why}")
    n = weight.shape[0]
    if qkv is None:
        qkv = torch.empty((1, n), dtype=x.dtype, device=x.device)
    out = check_qkv_inputs("qkv_gemv_decode_attention", qkv, cos_sin, num_heads, num_kv_heads, head_dim, cache, out,
                           q_norm, k_norm)
    if not qkv.is_contiguous():
        raise ValueError("qkv_gemv_decode_attention: qkv must be contiguous")
    norm = q_norm is not None
    rot = cos_sin.shape[1]
    group = num_heads // num_kv_heads
    nsplit = num_splits(1, num_kv_heads, workspace.num_sms)
    if MAX_SPLITS_IN_GRID:
        nsplit = min(nsplit, MAX_SPLITS_IN_GRID)
    c = tiles()
    p2 = triton.next_power_of_2
    ws = workspace
    k = x.shape[1]
    qkv_gemv_attention_kernel[(n // c["BLOCK_N"] + num_kv_heads * nsplit,)](
        x, weight, bias if bias is not None else weight, qkv, k, weight.stride(0),
        positions, cos_sin, out, cache, kv_positions, kv_indices, kv_indptr,
        q_norm if norm else qkv, k_norm if norm else qkv, ws.part_o, ws.part_ml, ws.counter, ws.rows_done,
        cos_sin.stride(0), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), eps, scale * LOG2E,
        nsplit, spin_limit,
        HQ=num_heads, HKV=num_kv_heads, D=head_dim, ROT=rot, PAGE=cache.shape[2], G=group,
        G_PAD=max(16, p2(group)), D_PAD=p2(head_dim), HALF_PAD=max(16, p2(rot // 2)),
        REST_PAD=max(16, p2(head_dim - rot)), QK_NORM=norm, BLOCK=64, SPLIT_PAD=MAX_SPLITS, G_MERGE=p2(group),
        HAS_BIAS=bias is not None, ROW=c["row"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
        EVEN_K=k % c["BLOCK_K"] == 0, STAGES=c["num_stages"], STRIDE=ROWS_DONE_STRIDE, num_warps=c["num_warps"],
        num_stages=ATTENTION_STAGES, **({"maxnreg": 128} if FOUR_PER_SM else {}), **launch_kwargs(1))
    return out
