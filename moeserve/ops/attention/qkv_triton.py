"""From the QKV projection to the paged KV cache in one Triton kernel: per-head q/k RMSNorm (when the model has
it), neox rotary embedding of q and k, q written out contiguous, k and v written into their cache slots.

Unfused, a layer launches a rotary kernel, a copy of q out of the strided projection, and FlashInfer's
``append_paged_kv_cache`` (and, with q/k norms, two norms and their copies): three to seven small kernels in a
row that each wait for the one before. Here it is one launch of ``(tokens, 2)`` programs: program 0 of a token
handles its q heads, program 1 its k and v heads. The cache slot of a token is found as FlashInfer's append
finds it, from the step's CSR metadata (``kv_indices[kv_indptr[b] + p // page_size]``, offset
``p % page_size``), so CUDA-graph replays that refill those buffers write where the attention kernel reads.

Numerics follow the unfused fast path: the norm in float32 (weight applied in float32, rounded once), the
rotation in float32 from the rounded normed values with the float32 cos/sin cache, rounded once.
``qkv_rope_append_reference`` is the same computation in torch, for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.pdl import launch_kwargs
from moeserve.ops.pdl_triton import wait_prior


@triton.jit
def _load_heads(src, heads, hmask, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr, D: tl.constexpr,
                ROT: tl.constexpr, CACHE: tl.constexpr):
    """The halves and the rest (``[H_PAD, *]``, float32, masked) of ``[H_PAD]`` heads of ``D`` at ``src``, as loaded:
    :func:`_norm_rope` turns them into :func:`_norm_rope_heads`' result. ``CACHE``: the loads' cache modifier
    (``".cg"`` where another program of the kernel wrote ``src``)."""
    HALF: tl.constexpr = ROT // 2
    d = tl.arange(0, HALF_PAD)
    r = tl.arange(0, REST_PAD)
    m = hmask[:, None] & (d[None, :] < HALF)
    mr = hmask[:, None] & (r[None, :] < D - ROT)
    row = src + heads[:, None] * D
    x1 = tl.load(row + d[None, :], mask=m, other=0.0, cache_modifier=CACHE).to(tl.float32)
    x2 = tl.load(row + HALF + d[None, :], mask=m, other=0.0, cache_modifier=CACHE).to(tl.float32)
    xr = tl.load(row + ROT + r[None, :], mask=mr, other=0.0, cache_modifier=CACHE).to(tl.float32)
    return x1, x2, xr


@triton.jit
def _norm_rope(x1, x2, xr, w_ptr, cos, sin, eps, out_dtype: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
               HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr, QK_NORM: tl.constexpr):
    """Heads as :func:`_load_heads` returns them, normed (``QK_NORM``) and rotated: the rotated halves and the
    unrotated rest (float32)."""
    HALF: tl.constexpr = ROT // 2
    d = tl.arange(0, HALF_PAD)
    r = tl.arange(0, REST_PAD)
    if QK_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xr * xr, axis=1)
        inv = (1.0 / tl.sqrt(ss / D + eps))[:, None]
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        wr = tl.load(w_ptr + ROT + r, mask=r < D - ROT, other=0.0).to(tl.float32)[None, :]
        x1 = (x1 * inv * w1).to(out_dtype).to(tl.float32)
        x2 = (x2 * inv * w2).to(out_dtype).to(tl.float32)
        xr = (xr * inv * wr).to(out_dtype).to(tl.float32)
    # the rotation's products fused as FlashInfer's rotary arithmetic rounds them (left to the compiler, the second
    # half's form followed the surrounding code: one bf16 ulp off FlashInfer's cache in rare elements)
    o1 = tl.fma(x1, cos[None, :], -(x2 * sin[None, :]))
    o2 = tl.fma(x1, sin[None, :], x2 * cos[None, :])
    return o1, o2, xr


@triton.jit
def _norm_rope_heads(src, heads, hmask, w_ptr, cos, sin, eps, out_dtype: tl.constexpr, D: tl.constexpr,
                     ROT: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr, QK_NORM: tl.constexpr,
                     CACHE: tl.constexpr):
    """The rotated halves and the unrotated rest of ``[H_PAD]`` heads of ``D`` at ``src`` (float32, masked);
    ``CACHE``: the loads' cache modifier (``".cg"`` where another program of the kernel wrote ``src``)."""
    x1, x2, xr = _load_heads(src, heads, hmask, HALF_PAD, REST_PAD, D, ROT, CACHE)
    return _norm_rope(x1, x2, xr, w_ptr, cos, sin, eps, out_dtype, D, ROT, HALF_PAD, REST_PAD, QK_NORM)


@triton.jit
def _store_heads(dst, stride_head, heads, hmask, o1, o2, xr, D: tl.constexpr, ROT: tl.constexpr,
                 HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr):
    HALF: tl.constexpr = ROT // 2
    d = tl.arange(0, HALF_PAD)
    r = tl.arange(0, REST_PAD)
    m = hmask[:, None] & (d[None, :] < HALF)
    mr = hmask[:, None] & (r[None, :] < D - ROT)
    row = dst + heads[:, None] * stride_head
    ty = dst.dtype.element_ty
    tl.store(row + d[None, :], o1.to(ty), mask=m)
    tl.store(row + HALF + d[None, :], o2.to(ty), mask=m)
    tl.store(row + ROT + r[None, :], xr.to(ty), mask=mr)


# the step's index tensors are slices of one packed buffer: their addresses are not always 16-byte aligned, and a
# kernel specialised on that would compile again for other step sizes
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "batch_ptr", "kv_pos_ptr", "kv_indices_ptr", "kv_indptr_ptr"])
def qkv_rope_append_kernel(qkv_ptr, pos_ptr, cos_sin_ptr, q_out_ptr, cache_ptr, batch_ptr, kv_pos_ptr,
                           kv_indices_ptr, kv_indptr_ptr, q_norm_ptr, k_norm_ptr, stride_qkv, stride_cs,
                           stride_qo, stride_page, stride_kv, stride_slot, stride_head, eps,
                           HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                           PAGE: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, D_PAD: tl.constexpr,
                           HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr, QK_NORM: tl.constexpr,
                           PDL: tl.constexpr = False):
    wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    HALF: tl.constexpr = ROT // 2
    d = tl.arange(0, HALF_PAD)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=d < HALF, other=0.0)
    src = qkv_ptr + t * stride_qkv
    out_dtype = q_out_ptr.dtype.element_ty
    # (the two branches' tensors have different head counts, so each has its own names: Triton types a name
    # assigned in both branches of an ``if`` as one)
    if part == 0:
        qh = tl.arange(0, HQ_PAD)
        qm = qh < HQ
        q1, q2, qr = _norm_rope_heads(src, qh, qm, q_norm_ptr, cos, sin, eps, out_dtype, D, ROT, HALF_PAD,
                                      REST_PAD, QK_NORM, "")
        _store_heads(q_out_ptr + t * stride_qo, D, qh, qm, q1, q2, qr, D, ROT, HALF_PAD, REST_PAD)
    else:
        kh = tl.arange(0, HKV_PAD)
        km = kh < HKV
        b = tl.load(batch_ptr + t)
        p = tl.load(kv_pos_ptr + t)
        page = tl.load(kv_indices_ptr + tl.load(kv_indptr_ptr + b) + p // PAGE).to(tl.int64)
        slot = cache_ptr + page * stride_page + (p % PAGE).to(tl.int64) * stride_slot
        k1, k2, kr = _norm_rope_heads(src + HQ * D, kh, km, k_norm_ptr, cos, sin, eps, out_dtype, D, ROT,
                                      HALF_PAD, REST_PAD, QK_NORM, "")
        _store_heads(slot, stride_head, kh, km, k1, k2, kr, D, ROT, HALF_PAD, REST_PAD)
        dd = tl.arange(0, D_PAD)
        mv = km[:, None] & (dd[None, :] < D)
        v = tl.load(src + (HQ + HKV) * D + kh[:, None] * D + dd[None, :], mask=mv, other=0.0)
        tl.store(slot + stride_kv + kh[:, None] * stride_head + dd[None, :], v, mask=mv)


def check_qkv_inputs(op: str, qkv, cos_sin, num_heads, num_kv_heads, head_dim, cache, out, q_norm,
                     k_norm) -> torch.Tensor:
    """The checks both kernels from the QKV projection make (``op`` names the caller in the messages); returns
    ``out``, or a new ``[T, Hq, D]`` tensor when it is None."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError(f"{op}: q_norm and k_norm go together")
    t, width = qkv.shape
    if width != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"{op}: qkv {tuple(qkv.shape)} is not [T, (Hq + 2 Hkv) * D] with contiguous rows")
    rot = cos_sin.shape[1]
    if rot % 2 or rot > head_dim:
        raise ValueError(f"{op}: rotary width {rot} must be even and at most head_dim {head_dim}")
    if cache.dim() != 5 or cache.shape[1] != 2 or tuple(cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(f"{op}: cache {tuple(cache.shape)} is not [pages, 2, page, Hkv, D]")
    if cache.dtype != qkv.dtype or cache.stride(4) != 1:
        raise ValueError(f"{op}: cache must be {qkv.dtype} with contiguous heads, got {cache.dtype}")
    if out is None:
        return torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if out.shape != (t, num_heads, head_dim) or out.dtype != qkv.dtype or not out.is_contiguous():
        raise ValueError(f"{op}: out {tuple(out.shape)} {out.dtype} is not a contiguous "
                         f"[{t}, {num_heads}, {head_dim}] tensor of {qkv.dtype}")
    return out


def qkv_rope_append(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                    num_kv_heads: int, head_dim: int, cache: torch.Tensor, batch_indices: torch.Tensor,
                    kv_positions: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                    eps: float = 1e-6, out: torch.Tensor | None = None) -> torch.Tensor:
    """q ``[T, Hq, D]`` (normed when ``q_norm``, rotated), with k (normed, rotated) and v of ``qkv``
    ``[T, (Hq + 2 Hkv) * D]`` written into ``cache`` ``[pages, 2, page_size, Hkv, D]`` (FlashInfer's NHD layer)
    at each token's slot. ``cos_sin``: float32 ``[positions, rotary_dim]``, cos then sin (neox rotation of the
    first ``rotary_dim`` dims of each head). ``q_norm``/``k_norm``: per-head RMSNorm weights ``[D]`` (both or
    neither). ``out``: where q goes (contiguous ``[T, Hq, D]`` of qkv's dtype), else a new tensor."""
    q = check_qkv_inputs("qkv_rope_append", qkv, cos_sin, num_heads, num_kv_heads, head_dim, cache, out, q_norm,
                         k_norm)
    t = qkv.shape[0]
    if t == 0:
        return q
    rot = cos_sin.shape[1]
    norm = q_norm is not None
    p2 = triton.next_power_of_2
    qkv_rope_append_kernel[(t, 2)](
        qkv, positions, cos_sin, q, cache, batch_indices, kv_positions, kv_indices, kv_indptr,
        q_norm if norm else qkv, k_norm if norm else qkv, qkv.stride(0), cos_sin.stride(0), q.stride(0),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), eps,
        HQ=num_heads, HKV=num_kv_heads, D=head_dim, ROT=rot, PAGE=cache.shape[2], HQ_PAD=p2(num_heads),
        HKV_PAD=p2(num_kv_heads), D_PAD=p2(head_dim), HALF_PAD=p2(rot // 2), REST_PAD=max(2, p2(head_dim - rot)),
        QK_NORM=norm, num_warps=4, **launch_kwargs(t))
    return q


def qkv_rope_append_reference(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                              num_kv_heads: int, head_dim: int, cache: torch.Tensor, batch_indices: torch.Tensor,
                              kv_positions: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                              q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                              eps: float = 1e-6) -> torch.Tensor:
    """:func:`qkv_rope_append` in torch (the same rounding points)."""
    t, dtype = qkv.shape[0], qkv.dtype
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.reshape(t, x.shape[1] // head_dim, head_dim) for x in (q, k, v))
    rot = cos_sin.shape[1]
    half = rot // 2
    cs = cos_sin[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def norm_rope(x, w):
        x = x.float()
        if w is not None:
            x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(dtype).float()
        x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(dtype)

    q, k = norm_rope(q, q_norm), norm_rope(k, k_norm)
    page_size = cache.shape[2]
    b, p = batch_indices.long(), kv_positions.long()
    pages = kv_indices.long()[kv_indptr.long()[b] + p // page_size]
    cache[pages, 0, p % page_size] = k
    cache[pages, 1, p % page_size] = v.to(dtype)
    return q
