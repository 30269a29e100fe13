"""A one-token decode step's attention half in one persistent Triton kernel: the residual add and input norm, the
QKV projection, rotary embedding and KV append, split-KV attention, the merge of its splits, the output
projection, the residual add and post-attention norm, and the router's GEMM.

Launched kernel by kernel, that half of a layer is a chain of six or more latency-bound kernels (add + RMSNorm,
QKV GEMV, attention, output GEMV, add + RMSNorm, the router's partial sums), each waiting for the one before and
each too short to reach the memory bandwidth: in a c=1 step of Qwen1.5-MoE on an H200 it took 28.4 us a layer
against 9.1 us of reads. Here one program per SM runs four phases separated by grid-wide barriers (one word
whose top bit each barrier flips, as CUDA's cooperative groups do it; every program is resident at once, as the
grid is the SM count and a program fits an SM). What a phase reads that no earlier phase writes is loaded between
the arrival at the barrier in front of it and the wait there: the attention's positions, pages and first block of
cached keys and values, part of the output projection's rows (into registers), the norm and router weights:

0. every program adds the residual, norms it (each its own copy, ``xn``) and computes its contiguous share of
   the QKV rows (a GEMV, bias added);
1. program ``(kv head h, split s)`` rotates q and k, attends over split ``s`` of the cached keys (the program whose
   split holds the new position also attends to the new key and writes the new key and value into the cache)
   and writes its partial (running max, sum and unnormalised output, float32); the last split of a kv head to
   finish (a counter per kv head, back at zero after) merges that head's partials into the attention output;
2. every program computes its share of the output projection's rows;
3. every program adds the residual and norms again, writes its slice of the new residual and of the norm, and
   program ``r`` computes router row ``r``'s logit (one partial sum, as ``routing_triton.router_partials`` gives).

``PHASE`` 0-3 compiles a single phase and no barrier: launched one after another they compute the same thing
(what the Triton interpreter, which runs programs one at a time, tests on the CPU). Numerics follow the
kernel-by-kernel path: FlashInfer's fused add + RMSNorm (the sum in float32, the residual rounded, the norm of
the float32 sum times the float32 weight rounded once), the GEMV (float32 accumulation, bias, rounded), the
one-kernel decode attention (``decode_triton``). ``attention_half_reference`` is the computation in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.attention import decode_kernel_takes_rotary
from moeserve.ops.attention.decode_triton import (LOG2E, MAX_SPLITS, _attend_split, _merge_partials, _split_setup,
                                                  _store_partial, decode_attention_reference)
from moeserve.ops.attention.qkv_triton import _norm_rope_heads
from moeserve.ops.pdl import launch_kwargs
from moeserve.ops.pdl_triton import let_next_start, wait_prior

BLOCK_KEYS = 64


@triton.jit
def _grid_arrive(sync_ptr, nprog, ON: tl.constexpr, FLIP: tl.constexpr = True):
    """The first half of a grid-wide barrier: this program's writes so far are released to the others and its
    arrival counted. Returns what :func:`_grid_wait` needs. Loads issued between the two (of what no other program
    writes before the barrier) overlap the wait; issued before the arrival they would hold it up, as the release
    waits for every outstanding access of the thread.

    ``FLIP`` (one word, as CUDA's cooperative groups do it): program 0 adds ``2**31 - (nprog - 1)`` and every
    other program 1, so the word's top bit flips when the last arrives and its low bits are back at zero; each
    program waits for the top bit to differ from the value it found, the last arriver not at all. Otherwise
    ``sync_ptr`` is ``[arrivals, generation]``: the last arriver resets the arrivals and bumps the generation."""
    old = 0
    last = False
    if ON:
        tl.debug_barrier()  # every thread's writes are issued before the arrival
        if FLIP:
            inc = tl.where(tl.program_id(0) == 0, 2147483647 - (nprog - 2), 1)
            old = tl.atomic_add(sync_ptr, inc, sem="acq_rel")
            last = ((old + inc) ^ old) < 0
        else:
            old = tl.atomic_add(sync_ptr + 1, 0, sem="relaxed")
            arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
            last = arrived == nprog - 1
            if last:
                tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
                tl.atomic_add(sync_ptr + 1, 1, sem="release")
    return old, last


@triton.jit
def _grid_wait(sync_ptr, arrival, ON: tl.constexpr, FLIP: tl.constexpr = True):
    """The second half: wait until every program has arrived; their writes before it are then visible."""
    if ON:
        old, last = arrival
        if not last:
            if FLIP:
                cur = tl.atomic_add(sync_ptr, 0, sem="acquire")
                while (cur ^ old) >= 0:
                    cur = tl.atomic_add(sync_ptr, 0, sem="acquire")
            else:
                cur = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
                while cur == old:
                    cur = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
        tl.debug_barrier()


@triton.jit
def _clock(t_ptr, k: tl.constexpr, ON: tl.constexpr):
    """With ``ON``: this SM's cycle counter into slot ``k`` of this program's timing row (``scripts/
    layer_kernel_bench.py --timing``)."""
    if ON:
        c = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(t_ptr + k, c)


@triton.jit
def _gemv_rows(w_ptr, x_ptr, lo, hi, K: tl.constexpr, K0: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr,
               XCACHE: tl.constexpr):
    """``w[r, K0:] . x[K0:]`` float32 for rows ``lo <= r < hi`` (at most ``ROWS``; the rest zero), float32
    accumulation; ``x`` is this program's own copy (written by it before a CTA barrier), or with
    ``XCACHE=".cg"`` one other programs wrote before a grid barrier."""
    rows = lo + tl.arange(0, ROWS)
    rm = rows < hi
    kk = tl.arange(0, BK)
    c = tl.arange(0, 16)
    acc = tl.zeros((ROWS, 16), dtype=tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    for k in range(K0, K, BK):
        if (K - K0) % BK == 0:
            w = tl.load(w_rows + (k + kk)[None, :], mask=rm[:, None], other=0.0)
            xt = tl.load(x_ptr + (k + kk)[:, None] + c[None, :] * 0, mask=(c == 0)[None, :], other=0.0,
                         cache_modifier=XCACHE)
        else:
            km = (k + kk) < K
            w = tl.load(w_rows + (k + kk)[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            xt = tl.load(x_ptr + (k + kk)[:, None] + c[None, :] * 0, mask=(c == 0)[None, :] & km[:, None], other=0.0,
                         cache_modifier=XCACHE)
        acc = tl.dot(w, xt, acc=acc)
    return tl.sum(acc, axis=1)


@triton.jit
def _attention_setup(pid, nsplit, pos_ptr, cos_sin_ptr, cache_ptr, kv_pos_ptr, kv_indices_ptr, kv_indptr_ptr,
                     stride_cs, stride_page, stride_kv, stride_slot, stride_head, HKV: tl.constexpr, D: tl.constexpr,
                     ROT: tl.constexpr, PAGE: tl.constexpr, D_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                     REST_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """What program ``pid``'s attention needs that no earlier phase writes: its (kv head, split), whether it has
    one (``active``), and :func:`decode_triton._split_setup`'s for it (an empty range without a split)."""
    active = pid < HKV * nsplit
    h = tl.minimum(pid // nsplit, HKV - 1)
    s = pid % nsplit
    cos, sin, kv_pos, first_page, start, end, stop, k1, k2, kr, v, nm = _split_setup(
        0, h, s, active, nsplit, pos_ptr, cos_sin_ptr, cache_ptr, kv_pos_ptr, kv_indices_ptr, kv_indptr_ptr, stride_cs,
        stride_page, stride_kv, stride_slot, stride_head, D, ROT, PAGE, D_PAD, HALF_PAD, REST_PAD, BLOCK)
    return active, h, s, cos, sin, kv_pos, first_page, start, end, stop, k1, k2, kr, v, nm


@triton.jit(do_not_specialize=["nsplit"],
            do_not_specialize_on_alignment=["pos_ptr", "kv_pos_ptr", "kv_indices_ptr", "kv_indptr_ptr"])
def attention_half_kernel(
        hid_ptr, res_ptr, out_ptr, norm1_ptr, wqkv_ptr, bqkv_ptr, wo_ptr, norm2_ptr, router_ptr, parts_ptr,
        pos_ptr, cos_sin_ptr, cache_ptr, kv_pos_ptr, kv_indices_ptr, kv_indptr_ptr, q_norm_ptr, k_norm_ptr,
        xn_ptr, xsum_ptr, qkv_ptr, part_o_ptr, part_ml_ptr, ao_ptr, y_ptr, sync_ptr, counter_ptr,
        stride_cs, stride_page, stride_kv, stride_slot, stride_head, eps, qk_eps, scale_log2, nsplit, router_rows,
        H: tl.constexpr, H_PAD: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
        ROT: tl.constexpr, PAGE: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
        HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr, QK_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
        QKV_ROWS: tl.constexpr, QKV_BK: tl.constexpr, O_ROWS: tl.constexpr, O_BK: tl.constexpr,
        SPLIT_PAD: tl.constexpr, BLOCK: tl.constexpr, ROUTER_N: tl.constexpr, FLIP: tl.constexpr = True,
        PRE_ATTN: tl.constexpr = True, O_PRE: tl.constexpr = 0, PRE_NEXT: tl.constexpr = True,
        PHASE: tl.constexpr = -1, PDL: tl.constexpr = False, TIMING: tl.constexpr = False, t_ptr=None):
    FUSED: tl.constexpr = PHASE < 0
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    NQKV: tl.constexpr = (HQ + 2 * HKV) * D
    HQD: tl.constexpr = HQ * D
    cdt = cache_ptr.dtype.element_ty
    hv = tl.arange(0, H_PAD)
    hm = hv < H
    if TIMING:
        t_ptr += pid * 8
    _clock(t_ptr, 0, TIMING)

    # ---- phase 0: residual add + input norm, QKV rows ------------------------------------------------------
    if FUSED or PHASE == 0:
        w1 = tl.load(norm1_ptr + hv, mask=hm, other=0.0).to(tl.float32)  # no earlier kernel writes it
        wait_prior(PDL, False)
        _clock(t_ptr, 1, TIMING)
        x = (tl.load(hid_ptr + hv, mask=hm, other=0.0).to(tl.float32)
             + tl.load(res_ptr + hv, mask=hm, other=0.0).to(tl.float32))
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        my_xn = xn_ptr + pid * H
        tl.store(my_xn + hv, (x * inv * w1).to(xn_ptr.dtype.element_ty), mask=hm)
        if not FUSED:
            if pid == 0:
                tl.store(xsum_ptr + hv, x, mask=hm)
        tl.debug_barrier()  # this program's copy of the norm is written before its GEMV reads it
        lo = pid * NQKV // nprog
        hi = (pid + 1) * NQKV // nprog
        rows = lo + tl.arange(0, QKV_ROWS)
        qkv = _gemv_rows(wqkv_ptr, my_xn, lo, hi, H, 0, QKV_ROWS, QKV_BK, "")
        if HAS_BIAS:
            qkv += tl.load(bqkv_ptr + rows, mask=rows < hi, other=0.0).to(tl.float32)
        tl.store(qkv_ptr + rows, qkv.to(qkv_ptr.dtype.element_ty), mask=rows < hi)
        _clock(t_ptr, 2, TIMING)
    arrival = _grid_arrive(sync_ptr, nprog, FUSED, FLIP)
    # the attention's inputs that phase 0 does not write, read while waiting at the barrier (``PRE_ATTN``)
    if (FUSED or PHASE == 1) and PRE_ATTN:
        active, h, s, cos, sin, kv_pos, first_page, start, end, stop, k1, k2, kr, v, nm = _attention_setup(
            pid, nsplit, pos_ptr, cos_sin_ptr, cache_ptr, kv_pos_ptr, kv_indices_ptr, kv_indptr_ptr, stride_cs,
            stride_page, stride_kv, stride_slot, stride_head, HKV, D, ROT, PAGE, D_PAD, HALF_PAD, REST_PAD, BLOCK)
    _grid_wait(sync_ptr, arrival, FUSED, FLIP)
    _clock(t_ptr, 3, TIMING)

    # ---- phase 1: attention of (kv head, split); the last split of a head merges them ----------------------
    if FUSED or PHASE == 1:
        if not PRE_ATTN:
            active, h, s, cos, sin, kv_pos, first_page, start, end, stop, k1, k2, kr, v, nm = _attention_setup(
                pid, nsplit, pos_ptr, cos_sin_ptr, cache_ptr, kv_pos_ptr, kv_indices_ptr, kv_indptr_ptr, stride_cs,
                stride_page, stride_kv, stride_slot, stride_head, HKV, D, ROT, PAGE, D_PAD, HALF_PAD, REST_PAD,
                BLOCK)
        if active:
            dd = tl.arange(0, D_PAD)
            g = tl.arange(0, G_PAD)
            gm = g < G
            qh = h * G + g
            q1, q2, qr = _norm_rope_heads(qkv_ptr, qh, gm, q_norm_ptr, cos, sin, qk_eps, cdt, D, ROT, HALF_PAD,
                                          REST_PAD, QK_NORM, ".cg")
            q1, q2, qr = q1.to(cdt), q2.to(cdt), qr.to(cdt)
            # the first block of keys was loaded with the setup
            m_i, l_i, acc = _attend_split(q1, q2, qr, k1, k2, kr, v, nm, qkv_ptr, cos, sin, k_norm_ptr, qk_eps,
                                          cache_ptr, kv_indices_ptr, first_page, kv_pos, start, stop, end, h,
                                          stride_page, stride_kv, stride_slot, stride_head, scale_log2, HQ, HKV, D,
                                          ROT, PAGE, G_PAD, D_PAD, HALF_PAD, REST_PAD, QK_NORM, BLOCK, ".cg")
            _store_partial(part_o_ptr, part_ml_ptr, qh * nsplit + s, gm, m_i, l_i, acc, D, D_PAD)  # [HQ, nsplit]
            # the last split of kv head h to finish merges its heads' splits into the output row
            tl.debug_barrier()
            done = tl.atomic_add(counter_ptr + h, 1, sem="acq_rel")
            if done == nsplit - 1:
                mer1 = _merge_partials(part_o_ptr, part_ml_ptr, qh, gm, nsplit, D, D_PAD, SPLIT_PAD)
                tl.store(ao_ptr + qh[:, None] * D + dd[None, :], mer1.to(ao_ptr.dtype.element_ty),
                         mask=gm[:, None] & (dd[None, :] < D))
                tl.atomic_xchg(counter_ptr + h, 0)  # ready for the next launch
        _clock(t_ptr, 4, TIMING)
    arrival = _grid_arrive(sync_ptr, nprog, FUSED, FLIP)
    # the first O_PRE columns of this program's output-projection rows, into registers while waiting
    olo = pid * H // nprog
    ohi = (pid + 1) * H // nprog
    orows = olo + tl.arange(0, O_ROWS)
    if (FUSED or PHASE == 2) and O_PRE > 0:
        ocol = tl.arange(0, O_PRE)
        wo_pre = tl.load(wo_ptr + orows.to(tl.int64)[:, None] * HQD + ocol[None, :], mask=(orows < ohi)[:, None],
                         other=0.0)
    _grid_wait(sync_ptr, arrival, FUSED, FLIP)
    _clock(t_ptr, 5, TIMING)

    # ---- phase 2: output projection rows --------------------------------------------------------------------
    if FUSED or PHASE == 2:
        yo = _gemv_rows(wo_ptr, ao_ptr, olo, ohi, HQD, O_PRE, O_ROWS, O_BK, ".cg")
        if O_PRE > 0:
            xo = tl.load(ao_ptr + ocol, cache_modifier=".cg").to(tl.float32)
            yo += tl.sum(wo_pre.to(tl.float32) * xo[None, :], axis=1)
        tl.store(y_ptr + orows, yo.to(y_ptr.dtype.element_ty), mask=orows < ohi)
        _clock(t_ptr, 6, TIMING)
    arrival = _grid_arrive(sync_ptr, nprog, FUSED, FLIP)
    # the post-attention norm's weight and this program's router row (``PRE_NEXT``: while waiting)
    if (FUSED or PHASE == 3) and PRE_NEXT:
        w2 = tl.load(norm2_ptr + hv, mask=hm, other=0.0).to(tl.float32)
        wr = tl.load(router_ptr + pid * H + hv, mask=hm & (pid < router_rows) & (pid < ROUTER_N), other=0.0)
    _grid_wait(sync_ptr, arrival, FUSED, FLIP)
    _clock(t_ptr, 7, TIMING)

    # ---- phase 3: residual add + post-attention norm, the router's logits -----------------------------------
    if FUSED or PHASE == 3:
        let_next_start(PDL)
        if not PRE_NEXT:
            w2 = tl.load(norm2_ptr + hv, mask=hm, other=0.0).to(tl.float32)
            wr = tl.load(router_ptr + pid * H + hv, mask=hm & (pid < router_rows) & (pid < ROUTER_N), other=0.0)
        if not FUSED:
            x = tl.load(xsum_ptr + hv, mask=hm, other=0.0)
        y = tl.load(y_ptr + hv, mask=hm, other=0.0, cache_modifier=".cg").to(tl.float32)
        x2 = y + x.to(res_ptr.dtype.element_ty).to(tl.float32)  # the residual as phase 0 left it, rounded
        inv2 = 1.0 / tl.sqrt(tl.sum(x2 * x2, axis=0) / H + eps)
        h2 = (x2 * inv2 * w2).to(out_ptr.dtype.element_ty)
        mine = hm & (hv >= pid * H // nprog) & (hv < (pid + 1) * H // nprog)
        tl.store(res_ptr + hv, x2.to(res_ptr.dtype.element_ty), mask=mine)
        tl.store(out_ptr + hv, h2, mask=mine)
        if ROUTER_N > 0:
            if pid < ROUTER_N:
                tl.store(parts_ptr + pid, tl.sum(wr.to(tl.float32) * h2.to(tl.float32), axis=0))


def router_columns(rows: int) -> int:
    """The columns of the router's partial sums for ``rows`` rows, as ``routing_triton.router_partials`` lays
    them out: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(rows))


class LayerWorkspace:
    """The scratch buffers and barrier words of :func:`attention_half` (fixed buffers: CUDA graphs replay against
    them), for one model's attention shapes on a GPU of ``num_sms`` SMs (the grid)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, num_sms: int | None = None):
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        self.num_sms = num_sms
        self.nsplit = max(1, min(MAX_SPLITS, num_sms // num_kv_heads))
        self.hidden, self.num_heads, self.num_kv_heads, self.head_dim = hidden, num_heads, num_kv_heads, head_dim
        f32 = dict(dtype=torch.float32, device=device)
        self.xn = torch.empty((num_sms, hidden), dtype=dtype, device=device)
        self.xsum = torch.empty(hidden, **f32)
        self.qkv = torch.empty((num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
        self.part_o = torch.empty(num_heads * self.nsplit * head_dim, **f32)
        self.part_ml = torch.empty(num_heads * self.nsplit * 2, **f32)
        self.ao = torch.empty(num_heads * head_dim, dtype=dtype, device=device)
        self.y = torch.empty(hidden, dtype=dtype, device=device)
        self.sync = torch.zeros(2, dtype=torch.int32, device=device)
        self.counter = torch.zeros(num_kv_heads, dtype=torch.int32, device=device)  # splits done, per kv head

    def takes_router(self, rows: int) -> bool:
        """Whether the kernel can compute a router of ``rows`` rows: one program per row of its partial sums
        (:func:`router_columns`)."""
        return router_columns(rows) <= self.num_sms

    def serves(self, num_kv_heads: int) -> bool:
        """Whether every (kv head, split) has a program: at least one per kv head."""
        return num_kv_heads <= self.num_sms


def layer_config(hidden: int, nqkv: int, hqd: int, num_sms: int) -> dict:
    """Tiles and options: each program's share of the QKV and output rows in one tile (at least 16 rows, the
    smallest ``tl.dot``), K tiles of 256 and 512; the one-word barrier (``FLIP``); the attention's inputs and the
    norm and router weights read before the barriers that precede their phases (``PRE_ATTN``, ``PRE_NEXT``); and
    ``O_PRE`` columns of the output projection's rows (a power of two, 16K elements a program, ~32 registers a
    thread at 4 warps) loaded into registers before the barrier that precedes that projection."""
    p2 = triton.next_power_of_2
    o_rows = max(16, p2(-(-hidden // num_sms)))
    return {"QKV_ROWS": max(16, p2(-(-nqkv // num_sms))), "QKV_BK": min(256, p2(hidden)),
            "O_ROWS": o_rows, "O_BK": min(512, p2(hqd)), "num_warps": 4, "num_stages": 3, "FLIP": True,
            "PRE_ATTN": True, "O_PRE": min(16384 // o_rows, 1 << (hqd.bit_length() - 1)), "PRE_NEXT": True}


def attention_half(hidden: torch.Tensor, residual: torch.Tensor, norm1: torch.Tensor, w_qkv: torch.Tensor,
                   b_qkv: torch.Tensor | None, w_o: torch.Tensor, norm2: torch.Tensor, eps: float,
                   positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                   cache: torch.Tensor, kv_positions: torch.Tensor, kv_indices: torch.Tensor,
                   kv_indptr: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                   qk_eps: float, scale: float, workspace: LayerWorkspace, router: torch.Tensor | None = None,
                   phased: bool = False, config: dict | None = None, timing: torch.Tensor | None = None):
    """A one-token decode step's attention half: ``(h, parts)`` where ``h [1, H]`` is the post-attention norm of
    the new residual, which is written into ``residual`` in place, and ``parts [1, 1, N2]`` float32 are the
    router's logits ``h . router^T`` (``router [N, H]``; None without a router) as a single partial sum.

    ``hidden`` and ``residual`` ``[1, H]``: the layer's input before its residual add; ``w_qkv [(Hq + 2 Hkv) * D,
    H]`` (+ ``b_qkv``), ``w_o [H, Hq * D]``, both contiguous in the model dtype; the attention's arguments as
    for :func:`moeserve.ops.attention.decode_triton.qkv_decode_attention` (one request, its pages
    ``kv_indices[kv_indptr[0]:]``). ``phased``: the four phases as four launches without barriers (the Triton
    interpreter, tests). ``config``: tiles and options (:func:`layer_config`); ``timing``: an int64 ``[SMs, 8]``
    tensor that gets each program's cycle counter at the phase boundaries (``scripts/layer_kernel_bench.py``)."""
    h_size = hidden.shape[-1]
    ws = workspace
    nqkv = (num_heads + 2 * num_kv_heads) * head_dim
    if (q_norm is None) != (k_norm is None):
        raise ValueError("attention_half: q_norm and k_norm go together")
    if cache.dim() != 5 or cache.shape[1] != 2 or tuple(cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(f"attention_half: cache {tuple(cache.shape)} is not [pages, 2, page, Hkv, D]")
    if cache.dtype != hidden.dtype or cache.stride(4) != 1 or ws.qkv.dtype != hidden.dtype:
        raise ValueError(f"attention_half: cache and workspace must be {hidden.dtype} with contiguous heads")
    if hidden.numel() != h_size or residual.shape != hidden.shape or w_qkv.shape != (nqkv, h_size):
        raise ValueError(f"attention_half: one token of hidden {h_size} and a QKV weight [{nqkv}, {h_size}], got "
                         f"hidden {tuple(hidden.shape)}, residual {tuple(residual.shape)}, weight {tuple(w_qkv.shape)}")
    if w_o.shape != (h_size, num_heads * head_dim) or not (w_qkv.is_contiguous() and w_o.is_contiguous()):
        raise ValueError(f"attention_half: output weight {tuple(w_o.shape)} is not a contiguous "
                         f"[{h_size}, {num_heads * head_dim}]")
    if num_heads % num_kv_heads or not decode_kernel_takes_rotary(head_dim, cos_sin.shape[1]):
        raise ValueError("attention_half: query heads not a multiple of kv heads, or a rotary width it cannot take")
    if (ws.hidden, ws.num_heads, ws.num_kv_heads, ws.head_dim) != (h_size, num_heads, num_kv_heads, head_dim):
        raise ValueError("attention_half: the workspace was made for other shapes")
    n = 0 if router is None else router.shape[0]
    router_n = 0 if router is None else router_columns(n)
    if router is not None and (router.shape[1] != h_size or not ws.takes_router(n) or not router.is_contiguous()):
        raise ValueError(f"attention_half: router {tuple(router.shape)} needs at most {ws.num_sms} rows of {h_size}")
    parts = torch.empty((1, 1, max(router_n, 1)), dtype=torch.float32, device=hidden.device)
    out = torch.empty_like(hidden)
    norm = q_norm is not None
    rot = cos_sin.shape[1]
    group = num_heads // num_kv_heads
    p2 = triton.next_power_of_2
    c = config or layer_config(h_size, nqkv, num_heads * head_dim, ws.num_sms)
    args = (hidden, residual, out, norm1, w_qkv, b_qkv if b_qkv is not None else w_qkv, w_o, norm2,
            router if router is not None else w_o, parts, positions, cos_sin, cache, kv_positions, kv_indices,
            kv_indptr, q_norm if norm else w_o, k_norm if norm else w_o, ws.xn, ws.xsum, ws.qkv, ws.part_o,
            ws.part_ml, ws.ao, ws.y, ws.sync, ws.counter, cos_sin.stride(0), cache.stride(0), cache.stride(1),
            cache.stride(2), cache.stride(3), eps, qk_eps, scale * LOG2E, ws.nsplit, n)
    kw = dict(H=h_size, H_PAD=p2(h_size), HQ=num_heads, HKV=num_kv_heads, D=head_dim, ROT=rot, PAGE=cache.shape[2],
              G=group, G_PAD=max(16, p2(group)), D_PAD=p2(head_dim), HALF_PAD=max(16, p2(rot // 2)),
              REST_PAD=max(16, p2(head_dim - rot)), QK_NORM=norm, HAS_BIAS=b_qkv is not None,
              QKV_ROWS=c["QKV_ROWS"], QKV_BK=c["QKV_BK"], O_ROWS=c["O_ROWS"], O_BK=c["O_BK"],
              SPLIT_PAD=max(2, p2(ws.nsplit)), BLOCK=BLOCK_KEYS,
              ROUTER_N=router_n, num_warps=c["num_warps"], num_stages=c["num_stages"],
              **{k: c[k] for k in ("FLIP", "PRE_ATTN", "O_PRE", "PRE_NEXT") if k in c})
    if timing is not None:
        kw.update(TIMING=True, t_ptr=timing)
    grid = (ws.num_sms,)
    if phased:
        for phase in range(4):
            attention_half_kernel[grid](*args, PHASE=phase, **kw)
    else:
        attention_half_kernel[grid](*args, **kw, **launch_kwargs(1))
    return out, parts if router is not None else None


def attention_half_reference(hidden, residual, norm1, w_qkv, b_qkv, w_o, norm2, eps, positions, cos_sin, num_heads,
                             num_kv_heads, head_dim, cache, kv_positions, kv_indices, kv_indptr, q_norm, k_norm,
                             qk_eps, scale, router=None):
    """:func:`attention_half` in torch, kernel by kernel as the unfused path computes it: ``(h, logits or None)``;
    ``residual`` and ``cache`` are updated in place."""
    def add_norm(x, res, w):
        s = x.float() + res.float()
        res.copy_(s.to(res.dtype))
        return (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)

    x = add_norm(hidden.view(1, -1), residual.view(1, -1), norm1)
    qkv = (x.float() @ w_qkv.float().T + (b_qkv.float() if b_qkv is not None else 0)).to(x.dtype)
    o = decode_attention_reference(qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim, cache, kv_positions,
                                   kv_indices, kv_indptr, q_norm, k_norm, qk_eps, scale)
    y = (o.view(1, -1).float() @ w_o.float().T).to(x.dtype)
    h = add_norm(y, residual.view(1, -1), norm2)
    logits = None if router is None else h.float() @ router.float().T
    return h, logits
