"""A decode step's attention from the QKV projection in one Triton kernel: q/k RMSNorm (when the model has it),
neox rotary embedding, the new key and value into the paged cache, and split-KV attention over each request's
pages, the splits merged by the last of them to finish.

On FlashInfer's path a decode layer launches the QKV kernel (``moeserve.ops.attention.qkv_triton``), the
split-KV decode kernel and, where it splits, a merge kernel: for a one-token step three latency-bound kernels
in a row that each wait for the one before. Here it is one launch of ``(tokens, kv heads, splits)`` programs.
Program ``(t, h, s)`` rotates the queries of kv head ``h``'s group, attends over split ``s`` of request ``t``'s
cached keys (positions ``[s * chunk, (s + 1) * chunk)``, the new token excluded), and the program whose split
holds the new token's position also attends to the new key and value from registers and writes them into
their cache slot. With one split a program writes its output; with several each writes its partial (running
max, sum and unnormalised output, float32) and adds one to its (token, head) counter; the program that finds
it was the last reads the partials back, merges them, writes the output and resets the counter to zero, so
the kernel can be replayed in a CUDA graph. The split count depends only on the step's token count
(:func:`num_splits`), so a captured graph keeps it. Under programmatic dependent launch a program loads its range
and its first block of cached keys and values before it waits for the QKV projection (no kernel of the step writes
them), so those loads overlap the projection; a one-token step on an H200 ended its attention 5.6 µs after the
projection where it took 8.6 µs when it waited first. After the wait the program whose split holds the new token
reads that token's key and value with q, before it attends over its cached keys (``NEW_EARLY``), not after them:
one round trip to L2 less on the path of the step's last split; c=1 decoded 0.4% and 0.5% faster in two A/Bs on
H200s (docs/results/2026-12-04-h200-z3).

Decode only: every token is its request's last (``kv_positions[t] + 1`` keys). Numerics follow the unfused
path: q and the new k rounded to the cache dtype after the rotation as the QKV kernel rounds them, scores and
softmax in float32, probabilities rounded to the cache dtype before the product with the values.
``decode_attention_reference`` is the same computation in torch, for tests.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moeserve.ops.attention import decode_kernel_takes_rotary
from moeserve.ops.attention.qkv_triton import (_load_heads, _norm_rope, _norm_rope_heads, _store_heads,
                                               check_qkv_inputs, qkv_rope_append_reference)
from moeserve.ops.pdl import launch_kwargs
from moeserve.ops.pdl_triton import wait_prior

MAX_SPLITS = 16
BLOCK_N = 64  # keys per iteration (four pages of 16)
NEW_EARLY = True  # the new token's key and value loaded with q, right after the wait (False: after the cached keys)
LOG2E = 1.4426950408889634
# int32 words between two kv heads' counters of the QKV GEMV's rows (moeserve.ops.attention.qkv_gemv_triton): a line
# of 128 bytes each
ROWS_DONE_STRIDE = 32


def num_splits(tokens: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per (token, kv head) for a step of ``tokens`` tokens: enough programs for about two per SM, at
    most ``MAX_SPLITS``."""
    return max(1, min(MAX_SPLITS, -(-2 * num_sms // max(1, tokens * num_kv_heads))))


@triton.jit
def _dot_halves(q1, q2, qr, k1, k2, kr, HAS_REST: tl.constexpr):
    """Scores ``[G, N]`` of queries and keys given as their rotated halves and unrotated rest."""
    s = tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))
    if HAS_REST:
        s += tl.dot(qr, tl.trans(kr))
    return s


@triton.jit
def _load_keys(cache_ptr, kv_indices_ptr, first_page, n0, stop, h, stride_page, stride_kv, stride_slot, stride_head,
               D: tl.constexpr, ROT: tl.constexpr, PAGE: tl.constexpr, D_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
               REST_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Cached keys and values ``[n0, n0 + BLOCK)`` of kv head ``h`` (those below ``stop``; the rest masked to
    zero) of a request whose pages are ``kv_indices[first_page:]``: ``(k1, k2, kr, v, mask)``, the keys as their
    rotated halves and unrotated rest."""
    HALF: tl.constexpr = ROT // 2
    HAS_REST: tl.constexpr = ROT < D
    d = tl.arange(0, HALF_PAD)
    r = tl.arange(0, REST_PAD)
    dd = tl.arange(0, D_PAD)
    n = n0 + tl.arange(0, BLOCK)
    nm = n < stop
    page = tl.load(kv_indices_ptr + first_page + n // PAGE, mask=nm, other=0).to(tl.int64)
    row = cache_ptr + h * stride_head + page * stride_page + (n % PAGE).to(tl.int64) * stride_slot
    k1 = tl.load(row[:, None] + d[None, :], mask=nm[:, None] & (d[None, :] < HALF), other=0.0)
    k2 = tl.load(row[:, None] + HALF + d[None, :], mask=nm[:, None] & (d[None, :] < HALF), other=0.0)
    if HAS_REST:
        kr = tl.load(row[:, None] + ROT + r[None, :], mask=nm[:, None] & (r[None, :] < D - ROT), other=0.0)
    else:
        kr = k1  # unused
    v = tl.load(row[:, None] + stride_kv + dd[None, :], mask=nm[:, None] & (dd[None, :] < D), other=0.0)
    return k1, k2, kr, v, nm


@triton.jit
def _attend_keys(q1, q2, qr, k1, k2, kr, v, nm, m_i, l_i, acc, scale_log2, HAS_REST: tl.constexpr):
    """The online softmax's running ``(max, sum, unnormalised output)`` after one block of keys (``nm``: which
    are keys; at least one must be)."""
    sc = _dot_halves(q1, q2, qr, k1, k2, kr, HAS_REST) * scale_log2
    sc = tl.where(nm[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _load_new(src, h, has, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
              D_PAD: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr, CACHE: tl.constexpr):
    """The newest key of kv head ``h`` as loaded from the QKV row ``src`` (``_load_heads``' halves and rest, rows
    ``[2, *]``, row 1 masked to zero) and its value ``[2, D_PAD]``; nothing is read where ``has`` is false."""
    dd = tl.arange(0, D_PAD)
    one = tl.arange(0, 2)
    om = (one < 1) & has
    kh = h + one
    kx1, kx2, kxr = _load_heads(src + HQ * D, kh, om, HALF_PAD, REST_PAD, D, ROT, CACHE)
    vn = tl.load(src + (HQ + HKV) * D + kh[:, None] * D + dd[None, :], mask=om[:, None] & (dd[None, :] < D),
                 other=0.0, cache_modifier=CACHE)
    return kx1, kx2, kxr, vn


@triton.jit
def _attend_loaded_new(q1, q2, qr, kx1, kx2, kxr, vn, page, cos, sin, k_norm_ptr, eps, cache_ptr, kv_pos, h,
                       stride_page, stride_kv, stride_slot, stride_head, scale_log2, m_i, l_i, acc, D: tl.constexpr,
                       ROT: tl.constexpr, PAGE: tl.constexpr, D_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                       REST_PAD: tl.constexpr, QK_NORM: tl.constexpr):
    """The running ``(max, sum, unnormalised output)`` after the newest key (position ``kv_pos``, on page
    ``page``) of kv head ``h``, given as :func:`_load_new` loaded it with its value: normed, rotated and written into
    its cache slot with its value, and attended from registers."""
    HAS_REST: tl.constexpr = ROT < D
    cdt = cache_ptr.dtype.element_ty
    dd = tl.arange(0, D_PAD)
    one = tl.arange(0, 2)
    om = one < 1
    kh = h + one
    k1n, k2n, krn = _norm_rope(kx1, kx2, kxr, k_norm_ptr, cos, sin, eps, cdt, D, ROT, HALF_PAD, REST_PAD, QK_NORM)
    slot = cache_ptr + page * stride_page + (kv_pos % PAGE).to(tl.int64) * stride_slot
    _store_heads(slot, stride_head, kh, om, k1n, k2n, krn, D, ROT, HALF_PAD, REST_PAD)
    tl.store(slot + stride_kv + kh[:, None] * stride_head + dd[None, :], vn, mask=om[:, None] & (dd[None, :] < D))
    # the new key as the cache holds it (row 0 of the two; row 1 is masked to zero)
    k1v = tl.sum(k1n.to(cdt).to(tl.float32), axis=0)
    k2v = tl.sum(k2n.to(cdt).to(tl.float32), axis=0)
    sn = tl.sum(q1.to(tl.float32) * k1v[None, :], axis=1) + tl.sum(q2.to(tl.float32) * k2v[None, :], axis=1)
    if HAS_REST:
        krv = tl.sum(krn.to(cdt).to(tl.float32), axis=0)
        sn += tl.sum(qr.to(tl.float32) * krv[None, :], axis=1)
    sn = sn * scale_log2
    m_new = tl.maximum(m_i, sn)
    alpha = tl.exp2(m_i - m_new)
    pn = tl.exp2(sn - m_new)
    l_i = l_i * alpha + pn
    vv = tl.sum(vn.to(tl.float32), axis=0)
    acc = acc * alpha[:, None] + pn.to(cdt).to(tl.float32)[:, None] * vv[None, :]
    return m_new, l_i, acc


@triton.jit
def _attend_new(q1, q2, qr, src, cos, sin, k_norm_ptr, eps, cache_ptr, kv_indices_ptr, first_page, kv_pos, h,
                stride_page, stride_kv, stride_slot, stride_head, scale_log2, m_i, l_i, acc, HQ: tl.constexpr,
                HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, PAGE: tl.constexpr, D_PAD: tl.constexpr,
                HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr, QK_NORM: tl.constexpr, CACHE: tl.constexpr):
    """:func:`_attend_loaded_new` of the newest key and value loaded here from the QKV row ``src`` (``CACHE``: its
    loads' cache modifier), its page from the request's pages ``kv_indices[first_page:]``."""
    kx1, kx2, kxr, vn = _load_new(src, h, True, HQ, HKV, D, ROT, D_PAD, HALF_PAD, REST_PAD, CACHE)
    page = tl.load(kv_indices_ptr + first_page + kv_pos // PAGE).to(tl.int64)
    return _attend_loaded_new(q1, q2, qr, kx1, kx2, kxr, vn, page, cos, sin, k_norm_ptr, eps, cache_ptr, kv_pos, h,
                              stride_page, stride_kv, stride_slot, stride_head, scale_log2, m_i, l_i, acc, D, ROT,
                              PAGE, D_PAD, HALF_PAD, REST_PAD, QK_NORM)


@triton.jit
def _attend_split(q1, q2, qr, k1, k2, kr, v, nm, src, cos, sin, k_norm_ptr, eps, cache_ptr, kv_indices_ptr,
                  first_page, kv_pos, start, stop, end, h, stride_page, stride_kv, stride_slot, stride_head, scale_log2,
                  HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, PAGE: tl.constexpr,
                  G_PAD: tl.constexpr, D_PAD: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
                  QK_NORM: tl.constexpr, BLOCK: tl.constexpr, CACHE: tl.constexpr, NEW: tl.constexpr = True):
    """``(running max, sum, unnormalised output)`` float32 of the queries of kv head ``h`` (``q1, q2, qr``: their
    rotated halves and unrotated rest, ``[G_PAD, *]`` in the cache dtype) over positions ``[start, end)`` of one
    request whose pages are ``kv_indices[first_page:]``: the cached keys ``[start, stop)`` (``stop``: ``end`` or
    ``kv_pos``, whichever is less) from the cache, the first block of them given as ``_load_keys`` returned it
    (``k1, k2, kr, v, nm``), and the newest (position ``kv_pos``, when the range holds it) from the QKV row ``src``,
    normed and rotated, written into its cache slot and attended from registers. ``CACHE``: the cache modifier of
    the loads from ``src``. ``NEW`` false: the newest key is left to the caller."""
    HAS_REST: tl.constexpr = ROT < D
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    if start < stop:  # the first block, loaded by the caller
        m_i, l_i, acc = _attend_keys(q1, q2, qr, k1, k2, kr, v, nm, m_i, l_i, acc, scale_log2, HAS_REST)
    for n0 in range(start + BLOCK, stop, BLOCK):
        k1n, k2n, krn, vn, nmn = _load_keys(cache_ptr, kv_indices_ptr, first_page, n0, stop, h, stride_page,
                                            stride_kv, stride_slot, stride_head, D, ROT, PAGE, D_PAD, HALF_PAD,
                                            REST_PAD, BLOCK)
        m_i, l_i, acc = _attend_keys(q1, q2, qr, k1n, k2n, krn, vn, nmn, m_i, l_i, acc, scale_log2, HAS_REST)
    if NEW:
        if (start <= kv_pos) & (kv_pos < end):  # this split holds the new token: attend to it, then cache it
            m_i, l_i, acc = _attend_new(q1, q2, qr, src, cos, sin, k_norm_ptr, eps, cache_ptr, kv_indices_ptr,
                                        first_page, kv_pos, h, stride_page, stride_kv, stride_slot, stride_head,
                                        scale_log2, m_i, l_i, acc, HQ, HKV, D, ROT, PAGE, D_PAD, HALF_PAD, REST_PAD,
                                        QK_NORM, CACHE)
    return m_i, l_i, acc


@triton.jit
def _split_setup(t, h, s, active, nsplit, pos_ptr, cos_sin_ptr, cache_ptr, kv_pos_ptr, kv_indices_ptr, kv_indptr_ptr,
                 stride_cs, stride_page, stride_kv, stride_slot, stride_head, D: tl.constexpr, ROT: tl.constexpr,
                 PAGE: tl.constexpr, D_PAD: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
                 BLOCK: tl.constexpr):
    """What split ``s`` of kv head ``h`` of a decode step's token ``t`` needs before it reads the QKV projection,
    none of it written earlier in the step: ``(cos, sin, kv_pos, first_page, start, end, stop, k1, k2, kr, v, nm)``,
    the token's rotary row, its position (the request holds ``kv_pos + 1`` keys) and first page, the split's range
    ``[start, end)`` of positions (``stop``: the end of its cached keys; the new one comes from the projection) and
    its first block of cached keys and values (:func:`_load_keys`). ``active`` false: an empty range."""
    HALF: tl.constexpr = ROT // 2
    d = tl.arange(0, HALF_PAD)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=d < HALF, other=0.0)
    # a decode step's token t is its request t (one load less in the chain before the first key)
    kv_pos = tl.load(kv_pos_ptr + t)
    first_page = tl.load(kv_indptr_ptr + t)
    per_split = tl.cdiv(tl.cdiv(kv_pos + 1, nsplit), BLOCK) * BLOCK
    start = tl.where(active, s * per_split, 0)
    end = tl.where(active, tl.minimum(start + per_split, kv_pos + 1), 0)
    stop = tl.minimum(end, kv_pos)
    k1, k2, kr, v, nm = _load_keys(cache_ptr, kv_indices_ptr, first_page, start, stop, h, stride_page, stride_kv,
                                   stride_slot, stride_head, D, ROT, PAGE, D_PAD, HALF_PAD, REST_PAD, BLOCK)
    return cos, sin, kv_pos, first_page, start, end, stop, k1, k2, kr, v, nm


@triton.jit
def _store_partial(part_o_ptr, part_ml_ptr, pidx, hmask, m_i, l_i, acc, D: tl.constexpr, D_PAD: tl.constexpr):
    """One split's partial of the heads ``hmask``: (max, sum) at ``part_ml[pidx]``, the output at ``part_o[pidx]``."""
    dd = tl.arange(0, D_PAD)
    tl.store(part_ml_ptr + pidx * 2, m_i, mask=hmask)
    tl.store(part_ml_ptr + pidx * 2 + 1, l_i, mask=hmask)
    tl.store(part_o_ptr + pidx[:, None] * D + dd[None, :], acc, mask=hmask[:, None] & (dd[None, :] < D))


@triton.jit
def _merge_partials(part_o_ptr, part_ml_ptr, heads, hmask, nsplit, D: tl.constexpr, D_PAD: tl.constexpr,
                    SPLIT_PAD: tl.constexpr):
    """The attention output ``[*, D_PAD]`` float32 of the heads ``hmask`` whose ``nsplit`` partials are at rows
    ``heads * nsplit + s``, every split read in one go (``.cg``: other programs wrote them)."""
    sp = tl.arange(0, SPLIT_PAD)
    dd = tl.arange(0, D_PAD)
    rows = heads[:, None] * nsplit + sp[None, :]
    mm = hmask[:, None] & (sp[None, :] < nsplit)
    ms = tl.load(part_ml_ptr + rows * 2, mask=mm, other=float("-inf"), cache_modifier=".cg")
    ls = tl.load(part_ml_ptr + rows * 2 + 1, mask=mm, other=0.0, cache_modifier=".cg")
    os_ = tl.load(part_o_ptr + rows[:, :, None] * D + dd[None, None, :],
                  mask=mm[:, :, None] & (dd[None, None, :] < D), other=0.0, cache_modifier=".cg")
    big = tl.max(ms, axis=1)
    big = tl.where(hmask, big, 0.0)  # padded rows: no split, no NaN
    w = tl.exp2(ms - big[:, None])
    total = tl.where(hmask, tl.sum(w * ls, axis=1), 1.0)
    return tl.sum(w[:, :, None] * os_, axis=1) / total[:, None]


# (index tensors are slices of one packed buffer, as for the QKV kernel; ``nsplit`` is not specialised on, so one
# compile serves every step size)
@triton.jit(do_not_specialize=["nsplit"],
            do_not_specialize_on_alignment=["pos_ptr", "kv_pos_ptr", "kv_indices_ptr", "kv_indptr_ptr"])
def qkv_decode_attention_kernel(
        qkv_ptr, pos_ptr, cos_sin_ptr, out_ptr, cache_ptr, kv_pos_ptr, kv_indices_ptr, kv_indptr_ptr,
        q_norm_ptr, k_norm_ptr, part_o_ptr, part_ml_ptr, counter_ptr,
        stride_qkv, stride_cs, stride_out, stride_page, stride_kv, stride_slot, stride_head, eps, scale_log2,
        nsplit,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, PAGE: tl.constexpr,
        G: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
        QK_NORM: tl.constexpr, BLOCK: tl.constexpr, SPLIT_PAD: tl.constexpr, G_MERGE: tl.constexpr,
        PDL: tl.constexpr = False, MERGE: tl.constexpr = True, NEW_EARLY: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2)
    cdt = cache_ptr.dtype.element_ty
    dd = tl.arange(0, D_PAD)
    # Before the wait for the QKV projection: what no kernel of this step writes before it. The step's positions
    # and pages were copied in before the step began, the cached keys below the new token's position were written
    # by earlier steps (only the new key's slot is written in this step, by this kernel). So this program's range
    # and its first block of keys and values are in flight while the projection runs.
    cos, sin, kv_pos, first_page, start, end, stop, k1, k2, kr, v, nm = _split_setup(
        t, h, s, True, nsplit, pos_ptr, cos_sin_ptr, cache_ptr, kv_pos_ptr, kv_indices_ptr, kv_indptr_ptr, stride_cs,
        stride_page, stride_kv, stride_slot, stride_head, D, ROT, PAGE, D_PAD, HALF_PAD, REST_PAD, BLOCK)
    if NEW_EARLY:  # the new token's page too; its split reads its key and value with q, right after the wait
        has_new = (start <= kv_pos) & (kv_pos < end)
        page_new = tl.load(kv_indices_ptr + first_page + kv_pos // PAGE).to(tl.int64)
    wait_prior(PDL)

    src = qkv_ptr + t * stride_qkv
    g = tl.arange(0, G_PAD)
    gm = g < G
    qh = h * G + g
    if NEW_EARLY:
        qx1, qx2, qxr = _load_heads(src, qh, gm, HALF_PAD, REST_PAD, D, ROT, "")
        kx1, kx2, kxr, vn = _load_new(src, h, has_new, HQ, HKV, D, ROT, D_PAD, HALF_PAD, REST_PAD, "")
        q1, q2, qr = _norm_rope(qx1, qx2, qxr, q_norm_ptr, cos, sin, eps, cdt, D, ROT, HALF_PAD, REST_PAD, QK_NORM)
    else:
        q1, q2, qr = _norm_rope_heads(src, qh, gm, q_norm_ptr, cos, sin, eps, cdt, D, ROT, HALF_PAD, REST_PAD,
                                      QK_NORM, "")
    q1, q2, qr = q1.to(cdt), q2.to(cdt), qr.to(cdt)  # as the QKV kernel writes q
    m_i, l_i, acc = _attend_split(q1, q2, qr, k1, k2, kr, v, nm, src, cos, sin, k_norm_ptr, eps, cache_ptr,
                                  kv_indices_ptr, first_page, kv_pos, start, stop, end, h, stride_page, stride_kv,
                                  stride_slot, stride_head, scale_log2, HQ, HKV, D, ROT, PAGE, G_PAD, D_PAD, HALF_PAD,
                                  REST_PAD, QK_NORM, BLOCK, "", not NEW_EARLY)
    if NEW_EARLY:
        if has_new:
            m_i, l_i, acc = _attend_loaded_new(q1, q2, qr, kx1, kx2, kxr, vn, page_new, cos, sin, k_norm_ptr, eps,
                                               cache_ptr, kv_pos, h, stride_page, stride_kv, stride_slot,
                                               stride_head, scale_log2, m_i, l_i, acc, D, ROT, PAGE, D_PAD, HALF_PAD,
                                               REST_PAD, QK_NORM)

    out_rows = out_ptr + t * stride_out + qh[:, None] * D + dd[None, :]
    omask = gm[:, None] & (dd[None, :] < D)
    if nsplit == 1:
        tl.store(out_rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=omask)
    else:
        # partials: [tokens, HQ, nsplit] x (m, l) and x D
        _store_partial(part_o_ptr, part_ml_ptr, (t * HQ + qh) * nsplit + s, gm, m_i, l_i, acc, D, D_PAD)
        if MERGE:  # (false: an experiment's knob, timing the kernel without its merge; the output is not written)
            tl.debug_barrier()  # every thread's partial is written before the counter moves
            done = tl.atomic_add(counter_ptr + t * HKV + h, 1, sem="acq_rel")
        else:
            done = -1
        if done == nsplit - 1:  # the last split of (t, h): merge, every split's partial read in one go
            mg = tl.arange(0, G_MERGE)
            mgm = mg < G
            merged = _merge_partials(part_o_ptr, part_ml_ptr, t * HQ + h * G + mg, mgm, nsplit, D, D_PAD, SPLIT_PAD)
            mrows = out_ptr + t * stride_out + (h * G + mg)[:, None] * D + dd[None, :]
            tl.store(mrows, merged.to(out_ptr.dtype.element_ty), mask=mgm[:, None] & (dd[None, :] < D))
            tl.atomic_xchg(counter_ptr + t * HKV + h, 0)  # ready for the next launch


class DecodeWorkspace:
    """The partials and counters of :func:`qkv_decode_attention` for steps of up to ``max_tokens`` tokens (fixed
    buffers: CUDA graphs replay against them)."""

    def __init__(self, max_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 num_sms: int | None = None, max_context: int | None = None):
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
        self.max_tokens, self.num_sms = max_tokens, num_sms
        self.max_context = max_context  # longest request a step may hold (None: any)
        slots = max(t * num_splits(t, num_kv_heads, num_sms) for t in range(1, max_tokens + 1))
        self.part_o = torch.empty(slots * num_heads * head_dim, dtype=torch.float32, device=device)
        self.part_ml = torch.empty(slots * num_heads * 2, dtype=torch.float32, device=device)
        self.counter = torch.zeros(max_tokens * num_kv_heads, dtype=torch.int32, device=device)
        # qkv_gemv_triton's grid (one-token steps): how many GEMV programs wrote each kv head's rows
        self.rows_done = torch.zeros(num_kv_heads * ROWS_DONE_STRIDE, dtype=torch.int32, device=device)
        self.num_kv_heads = num_kv_heads

    def serves(self, tokens: int, longest: int | None = None) -> bool:
        """Whether a decode step of ``tokens`` tokens runs here: at most ``max_tokens``, and enough (token, head,
        split) programs for one per SM at the most splits (with fewer, as for a model of few kv heads at one or
        two tokens, each program streams a long request's keys alone and FlashInfer's decode is left the step);
        given ``longest``, the tokens its longest request holds, also at most ``max_context`` of them (longer
        requests stream more keys per program than FlashInfer's finer splits do)."""
        if longest is not None and self.max_context is not None and longest > self.max_context:
            return False
        return tokens <= self.max_tokens and tokens * self.num_kv_heads * MAX_SPLITS >= self.num_sms


def _check(qkv, cos_sin, num_heads, num_kv_heads, head_dim, ws):
    """What this kernel needs beyond the QKV kernel's inputs (``check_qkv_inputs``)."""
    t = qkv.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"qkv_decode_attention: {num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    rot = cos_sin.shape[1]
    if not decode_kernel_takes_rotary(head_dim, rot):
        raise ValueError(f"qkv_decode_attention: rotary width {rot} must be all of head_dim {head_dim} or at "
                         "least 16 less")
    if t > ws.max_tokens:
        raise ValueError(f"qkv_decode_attention: {t} tokens, the workspace holds {ws.max_tokens}")


def qkv_decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                         num_kv_heads: int, head_dim: int, cache: torch.Tensor, kv_positions: torch.Tensor,
                         kv_indices: torch.Tensor, kv_indptr: torch.Tensor, q_norm: torch.Tensor | None,
                         k_norm: torch.Tensor | None, eps: float, scale: float, workspace: DecodeWorkspace,
                         out: torch.Tensor | None = None, block: int = BLOCK_N, num_warps: int = 2,
                         num_stages: int = 2, merge: bool = True) -> torch.Tensor:
    """Attention output ``[T, Hq, D]`` of a decode step (each token its request's newest) from ``qkv``
    ``[T, (Hq + 2 Hkv) * D]``: q and k normed (``q_norm``/``k_norm``, both or neither) and rotated as
    :func:`moeserve.ops.attention.qkv_triton.qkv_rope_append` does, k and v written into ``cache``
    ``[pages, 2, page_size, Hkv, D]`` at position ``kv_positions[t]`` of request ``t`` (a decode step's token
    ``t`` is its request ``t``; pages ``kv_indices[kv_indptr[t]:]``), and each query attending over that
    request's ``kv_positions[t] + 1`` keys with softmax scale ``scale``. ``block`` (keys per iteration),
    ``num_warps`` and ``num_stages`` are the launch's tuning; ``merge=False`` is a timing-only variant for
    ``scripts/attention_variants.py`` that leaves the output unwritten wherever the step splits."""
    out = check_qkv_inputs("qkv_decode_attention", qkv, cos_sin, num_heads, num_kv_heads, head_dim, cache, out,
                           q_norm, k_norm)
    _check(qkv, cos_sin, num_heads, num_kv_heads, head_dim, workspace)
    t = qkv.shape[0]
    if t == 0:
        return out
    norm = q_norm is not None
    rot = cos_sin.shape[1]
    group = num_heads // num_kv_heads
    nsplit = num_splits(t, num_kv_heads, workspace.num_sms)
    p2 = triton.next_power_of_2
    ws = workspace
    qkv_decode_attention_kernel[(t, num_kv_heads, nsplit)](
        qkv, positions, cos_sin, out, cache, kv_positions, kv_indices, kv_indptr,
        q_norm if norm else qkv, k_norm if norm else qkv, ws.part_o, ws.part_ml, ws.counter,
        qkv.stride(0), cos_sin.stride(0), out.stride(0), cache.stride(0), cache.stride(1), cache.stride(2),
        cache.stride(3), eps, scale * LOG2E, nsplit,
        HQ=num_heads, HKV=num_kv_heads, D=head_dim, ROT=rot, PAGE=cache.shape[2], G=group,
        G_PAD=max(16, p2(group)), D_PAD=p2(head_dim), HALF_PAD=max(16, p2(rot // 2)),
        REST_PAD=max(16, p2(head_dim - rot)), QK_NORM=norm, BLOCK=block, SPLIT_PAD=MAX_SPLITS,
        G_MERGE=p2(group), MERGE=merge, NEW_EARLY=NEW_EARLY, num_warps=num_warps, num_stages=num_stages,
        **launch_kwargs(t))
    return out


def decode_attention_reference(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                               num_kv_heads: int, head_dim: int, cache: torch.Tensor, kv_positions: torch.Tensor,
                               kv_indices: torch.Tensor, kv_indptr: torch.Tensor, q_norm: torch.Tensor | None,
                               k_norm: torch.Tensor | None, eps: float, scale: float) -> torch.Tensor:
    """:func:`qkv_decode_attention` in torch: the QKV reference (rotation, cache writes), then each token's
    attention over its request's keys in float32."""
    batch = torch.arange(qkv.shape[0], dtype=torch.int32, device=qkv.device)
    q = qkv_rope_append_reference(qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim, cache, batch,
                                  kv_positions, kv_indices, kv_indptr, q_norm, k_norm, eps)
    page, group = cache.shape[2], num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        n = int(kv_positions[i]) + 1
        start = int(kv_indptr[i])
        pages = kv_indices[start:start + math.ceil(n / page)].long()
        k = cache[pages, 0].reshape(-1, num_kv_heads, head_dim)[:n].float()
        v = cache[pages, 1].reshape(-1, num_kv_heads, head_dim)[:n].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out
