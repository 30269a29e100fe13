"""Softmax (Qwen, Mixtral) and Llama-4 routing as one Triton kernel: top-k and weights for every token in
one launch.

The torch reference (``routing.softmax_topk``, ``routing.llama4_topk``) runs softmax, ``torch.topk``
(two kernels on a GPU) and the renormalisation as separate launches per layer; at small batches those
launches cost more than the router's GEMM. Here one program handles one token: it loads the token's
logits, picks the ``k`` largest (the lowest index first among equal logits), and writes
- ``softmax``: their softmax probabilities, or with ``renormalize`` the softmax over the chosen ``k``
  (the same numbers as renormalising the full softmax, without computing it);
- ``llama4``: the sigmoid of the chosen logits.

Logits may be a column slice of a wider tensor (the router GEMM merged with the shared expert's gate):
rows are addressed by their stride. No host synchronisation, so it can be captured in a CUDA graph.

Small steps (``router_split_k_max_tokens``) also take the router's GEMM off cuBLAS: ``_router_partial_kernel``
splits ``K`` over 32 programs, each reading a slice of every router row, and writes float32 partial sums that
the routing kernel adds in a fixed order (the result does not depend on scheduling), rounds to the model's
dtype as the GEMM's output would be, stores as the logits (the shared expert's gate is one of their columns)
and routes on. For a few tokens cuBLAS runs this GEMM (60-odd rows) with a 64x8 tile and no split-K, one thread
block by its tile shape, reading whole rows: 14 us per layer in a Qwen1.5-MoE decode step on an H200.

``router_fuse_norm`` (steps of at most ``ROUTER_NORM_MAX_TOKENS`` tokens) folds the layer's post-attention
residual add and RMS norm into those partial sums: ``_add_norm_router_partial_kernel``'s program ``(s, t)``
normalises token ``t``'s whole row (FlashInfer's ``fused_add_rmsnorm`` arithmetic), writes slice ``s`` of the
normalised row and of the new residual (into fresh tensors: other programs still read the old residual) and
the partial sums of that slice, one launch where the norm and the router's partial GEMM were two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.eager import eager
from moeserve.ops.moe.routing_config import RouterPartials
from moeserve.ops.pdl import launch_kwargs
from moeserve.ops.pdl_triton import let_next_start, wait_prior

MAX_EXPERTS = 4096
MAX_TOPK = 64
METHODS = ("softmax", "llama4")


@triton.jit
def _select(x, valid, offs, t, gate, weights_ptr, ids_ptr, E, K: tl.constexpr, BLOCK_E: tl.constexpr,
            BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr,
            GATED: tl.constexpr):
    """Top-k of one token's logits ``x`` (``-inf`` outside ``valid``) and their weights, stored at row ``t``;
    ``gate``: the shared expert's gate logit (read when ``GATED``)."""
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    rest = x
    for j in tl.static_range(K):
        best = tl.max(rest, axis=0)
        idx = tl.min(tl.where(valid & (rest == best), offs, BLOCK_E), axis=0)
        chosen = tl.where(slots == j, best, chosen)
        ids = tl.where(slots == j, idx, ids)
        rest = tl.where(offs == idx, float("-inf"), rest)
    in_k = slots < K
    if SOFTMAX:
        top = tl.max(x, axis=0)
        e = tl.where(in_k, tl.exp(chosen - top), 0.0)
        if RENORM:
            w = e / tl.sum(e, axis=0)
        else:
            w = e / tl.sum(tl.where(valid, tl.exp(x - top), 0.0), axis=0)
    else:
        w = tl.sigmoid(chosen)
    if SHARED > 0:  # the fused shared expert's pieces: ids E.., weight sigmoid(gate logit at column E) or 1
        if GATED:
            shared_w = tl.sigmoid(gate)
        else:
            shared_w = 1.0
        is_shared = (slots >= K) & (slots < K + SHARED)
        w = tl.where(is_shared, shared_w, w)
        ids = tl.where(is_shared, E + slots - K, ids)
    tl.store(weights_ptr + t * (K + SHARED) + slots, w, mask=slots < K + SHARED)
    tl.store(ids_ptr + t * (K + SHARED) + slots, ids, mask=slots < K + SHARED)


@triton.jit
def _route_parts(parts, logits_ptr, offs, t, weights_ptr, ids_ptr, E, ROWS, K: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr,
                 GATED: tl.constexpr):
    """Token ``t``'s routing from its router's partial sums ``parts`` ``[*, BLOCK_E]`` (float32, one row a slice of
    the hidden size): their sum rounded to the logits' dtype as a GEMM writing them would, its ``ROWS`` logits
    stored in row ``t`` of ``logits`` (the shared expert's gate among them, logit ``E``), and :func:`_select` on
    the first ``E``."""
    logits = tl.sum(parts, axis=0).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + t * ROWS + offs, logits, mask=offs < ROWS)
    x_all = logits.to(tl.float32)
    valid = offs < E
    gate = tl.sum(tl.where(offs == E, x_all, 0.0), axis=0)
    _select(tl.where(valid, x_all, float("-inf")), valid, offs, t, gate, weights_ptr, ids_ptr, E, K, BLOCK_E, BLOCK_K,
            SOFTMAX, RENORM, SHARED, GATED)


@triton.jit
def _topk_route_kernel(logits_ptr, stride_t, weights_ptr, ids_ptr, E, K: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr,
                       SHARED: tl.constexpr = 0, GATED: tl.constexpr = False, PDL: tl.constexpr = False):
    wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + t * stride_t + offs, mask=valid, other=float("-inf")).to(tl.float32)
    gate = 0.0
    if GATED:
        gate = tl.load(logits_ptr + t * stride_t + E).to(tl.float32)
    _select(x, valid, offs, t, gate, weights_ptr, ids_ptr, E, K, BLOCK_E, BLOCK_K, SOFTMAX, RENORM, SHARED, GATED)


@triton.jit
def _router_partial_kernel(x_ptr, w_ptr, part_ptr, T, N, K, stride_xt, stride_wn, BLOCK_T: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
                           PDL: tl.constexpr = False):
    """``part[s, t, n] = sum over slice s of K of x[t, k] * w[n, k]`` (float32): program ``(s, j)`` reads
    ``K_ITERS * BLOCK_K`` columns of every router row, for tokens ``j * BLOCK_T ..``."""
    wait_prior(PDL)
    s = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.arange(0, BLOCK_N)
    t_mask = offs_t < T
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for i in tl.static_range(K_ITERS):
        offs_k = (s * K_ITERS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
                    mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None],
                     other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, wt, acc=acc)
    out = part_ptr + (s * T + offs_t[:, None].to(tl.int64)) * BLOCK_N + offs_n[None, :]
    tl.store(out, acc, mask=t_mask[:, None])


@triton.jit
def _add_norm_router_partial_kernel(x_ptr, res_ptr, nw_ptr, h_ptr, res_out_ptr, w_ptr, part_ptr, T, N, H, eps,
                                    stride_xt, stride_rt, stride_wn, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                                    BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Program ``(s, t)``: ``r = x[t] + res[t]``, ``h[t] = r * rsqrt(mean(r^2) + eps) * nw`` over the whole row;
    stores slice ``s`` (``BLOCK_K`` columns) of ``h`` and of ``r`` (rounded) and ``part[s, t, n] = sum over the
    slice of h[t, k] * w[n, k]`` (float32, from the rounded ``h`` as the router's GEMM would read it)."""
    wait_prior(PDL)
    s = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    m = cols < H
    r = (tl.load(x_ptr + t * stride_xt + cols, mask=m, other=0.0).to(tl.float32)
         + tl.load(res_ptr + t * stride_rt + cols, mask=m, other=0.0).to(tl.float32))
    rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / H + eps)
    offs_k = s * BLOCK_K + tl.arange(0, BLOCK_K)
    km = offs_k < H
    rs = (tl.load(x_ptr + t * stride_xt + offs_k, mask=km, other=0.0).to(tl.float32)
          + tl.load(res_ptr + t * stride_rt + offs_k, mask=km, other=0.0).to(tl.float32))
    dtype = h_ptr.dtype.element_ty
    hs = (rs * rstd * tl.load(nw_ptr + offs_k, mask=km, other=0.0).to(tl.float32)).to(dtype)
    tl.store(h_ptr + t * H + offs_k, hs, mask=km)
    tl.store(res_out_ptr + t * H + offs_k, rs.to(dtype), mask=km)
    offs_n = tl.arange(0, BLOCK_N)
    w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=(offs_n < N)[:, None] & km[None, :],
                other=0.0)
    part = tl.sum(w.to(tl.float32) * hs.to(tl.float32)[None, :], axis=1)
    tl.store(part_ptr + (s * T + t) * BLOCK_N + offs_n, part)


@triton.jit
def _topk_route_partials_kernel(part_ptr, T, logits_ptr, weights_ptr, ids_ptr, E, ROWS, SPLITS,
                                K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                                SOFTMAX: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr = 0,
                                GATED: tl.constexpr = False, PDL: tl.constexpr = False,
                                LET_EARLY: tl.constexpr = False):
    """Adds one token's partial sums (``part [SPLITS, T, BLOCK_E]``, loaded at once), rounds them to the logits'
    dtype as a GEMM writing them would, stores the ``ROWS`` logits (the shared expert's gate among them) and
    routes on the first ``E``. ``LET_EARLY``: the next kernel may be scheduled as soon as this one is, before
    it waits for the router (see :func:`topk_route_partials`)."""
    if LET_EARLY:
        let_next_start(PDL)
        wait_prior(PDL, LET_NEXT=False)
    else:
        wait_prior(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    offs_s = tl.arange(0, BLOCK_S)
    parts = tl.load(part_ptr + (offs_s[:, None] * T + t) * BLOCK_E + offs[None, :], mask=(offs_s < SPLITS)[:, None],
                    other=0.0)
    _route_parts(parts, logits_ptr, offs, t, weights_ptr, ids_ptr, E, ROWS, K, BLOCK_E, BLOCK_K, SOFTMAX,
                 RENORM, SHARED, GATED)


def unsupported(method: str, num_experts: int, top_k: int) -> str | None:
    """None when the kernel computes this routing, else why not."""
    if method not in METHODS:
        return f"routing is {method}"
    if not 1 <= top_k <= min(num_experts, MAX_TOPK):
        return f"top_k {top_k} is outside 1..{min(num_experts, MAX_TOPK)}"
    if num_experts > MAX_EXPERTS:
        return f"{num_experts} experts (max {MAX_EXPERTS})"
    return None


def topk_route(logits: torch.Tensor, method: str, top_k: int, renormalize: bool = False, shared: int = 0,
               gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32 [T, k], ids int32 [T, k])`` for ``logits [T, E]`` (any float dtype; its last
    dimension contiguous), as ``routing.softmax_topk`` / ``routing.llama4_topk`` compute them.

    ``shared``: append that many columns for a fused shared expert (``routing.append_shared``): ids ``E ..
    E + shared - 1``, weight the sigmoid of the gate logit in column ``E`` of the same rows of the underlying
    tensor (``gated``, the router GEMM merged with the gate) or 1."""
    t, e = logits.shape
    why = unsupported(method, e, top_k)
    if why is not None:
        raise ValueError(f"Triton routing: {why}")
    if gated and (logits.stride(1) != 1 or logits.stride(0) < e + 1):
        raise ValueError("Triton routing: a gated shared expert needs the gate logit in column E of the logits' rows")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    width = top_k + shared
    weights = torch.empty((t, width), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, width), dtype=torch.int32, device=logits.device)
    if t:
        block_e = triton.next_power_of_2(e)
        _topk_route_kernel[(t,)](logits, logits.stride(0), weights, ids, e, K=top_k, BLOCK_E=block_e,
                                 BLOCK_K=triton.next_power_of_2(width), SOFTMAX=method == "softmax",
                                 RENORM=renormalize, SHARED=shared, GATED=gated, num_warps=1 if block_e <= 128 else 4,
                                 **launch_kwargs(t))
    return weights, ids


ROUTER_BLOCK_K = 64
ROUTER_SPLITS = 32  # programs along K: each reads ROUTER_BLOCK_K (or a few times that) columns of every router row
ROUTER_MAX_ROWS = 256
ROUTER_MAX_TOKENS = 64  # one program holds its tokens' partial sums at once (BLOCK_T)


def router_partials(x: torch.Tensor, weight: torch.Tensor) -> RouterPartials:
    """The router's GEMM ``x [T, K] @ weight [N, K]^T`` as partial sums over ``K`` for the routing kernel: at a
    few tokens cuBLAS picks a tile that covers the rows whole, so one or two thread blocks read the weight (14 us
    in a Qwen1.5-MoE decode step on an H200); here ``ROUTER_SPLITS`` programs read a slice each. ``T`` at most
    ``ROUTER_MAX_TOKENS``, ``N`` at most ``ROUTER_MAX_ROWS``."""
    t, k = x.shape
    n = weight.shape[0]
    if t > ROUTER_MAX_TOKENS or n > ROUTER_MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"router_partials: x {tuple(x.shape)}, weight {tuple(weight.shape)} (at most "
                         f"{ROUTER_MAX_TOKENS} tokens and {ROUTER_MAX_ROWS} rows)")
    if x.stride(1) != 1:
        x = x.contiguous()
    block_n = max(16, triton.next_power_of_2(n))
    k_iters = max(1, triton.cdiv(k, ROUTER_BLOCK_K * ROUTER_SPLITS))
    splits = triton.cdiv(k, ROUTER_BLOCK_K * k_iters)
    parts = torch.empty((splits, t, block_n), dtype=torch.float32, device=x.device)
    if t:
        block_t = max(16, triton.next_power_of_2(t))
        _router_partial_kernel[(splits, triton.cdiv(t, block_t))](
            x, weight, parts, t, n, k, x.stride(0), weight.stride(0), BLOCK_T=block_t, BLOCK_N=block_n,
            BLOCK_K=ROUTER_BLOCK_K, K_ITERS=k_iters, num_warps=4, **launch_kwargs(t))
    return RouterPartials(parts, n, weight.dtype)


ROUTER_NORM_MAX_TOKENS = 16  # one program per (slice, token): the weight slice is read once per token
ROUTER_NORM_MAX_HIDDEN = 16384  # each program holds a whole row


def add_norm_router_partials(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RouterPartials]:
    """``(h, new residual, partials)``: the post-attention ``residual + x`` and its RMS norm times
    ``norm_weight`` (FlashInfer's ``fused_add_rmsnorm``, here into fresh tensors), with the router's GEMM
    ``h @ weight^T`` as partial sums over slices of the hidden size (:func:`router_partials`). ``T`` at most
    ``ROUTER_NORM_MAX_TOKENS``, ``N`` at most ``ROUTER_MAX_ROWS``."""
    t, k = x.shape
    n = weight.shape[0]
    if (t > ROUTER_NORM_MAX_TOKENS or n > ROUTER_MAX_ROWS or weight.shape[1] != k or residual.shape != x.shape
            or k > ROUTER_NORM_MAX_HIDDEN):
        raise ValueError(f"add_norm_router_partials: x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight "
                         f"{tuple(weight.shape)} (at most {ROUTER_NORM_MAX_TOKENS} tokens, {ROUTER_MAX_ROWS} rows, "
                         f"a hidden size of {ROUTER_NORM_MAX_HIDDEN})")
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual.stride(1) != 1:
        residual = residual.contiguous()
    block_n = max(16, triton.next_power_of_2(n))
    splits = triton.cdiv(k, ROUTER_BLOCK_K)
    h = torch.empty((t, k), dtype=x.dtype, device=x.device)
    new_residual = torch.empty((t, k), dtype=residual.dtype, device=x.device)
    parts = torch.empty((splits, t, block_n), dtype=torch.float32, device=x.device)
    if t:
        _add_norm_router_partial_kernel[(splits, t)](
            x, residual, norm_weight, h, new_residual, weight, parts, t, n, k, float(eps), x.stride(0),
            residual.stride(0), weight.stride(0), BLOCK_H=triton.next_power_of_2(k), BLOCK_N=block_n,
            BLOCK_K=ROUTER_BLOCK_K, num_warps=4, **launch_kwargs(t))
    return h, new_residual, RouterPartials(parts, n, weight.dtype)


def topk_route_partials(p: RouterPartials, num_experts: int, method: str, top_k: int, renormalize: bool = False,
                        shared: int = 0, gated: bool = False, let_early: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`topk_route` of the logits whose partial sums ``p`` holds (their first ``num_experts`` columns;
    with ``gated``, column ``num_experts`` is the shared expert's gate). Returns ``(weights, ids, logits)``,
    the logits ``[T, rows]`` in ``p.dtype`` as the router's GEMM would have written them. ``let_early``
    (launched with PDL): the next kernel may start as soon as this one does, while the router that wrote the
    partial sums still runs; then only what was complete before the router's own wait (its input, not written
    by the router) may be read by that kernel before it waits: the fused MoE's tiles of a shared expert
    (``triton_kernels.fused_moe``'s ``fixed_tail``)."""
    splits, t, block_e = p.parts.shape
    why = unsupported(method, num_experts, top_k)
    if why is not None:
        raise ValueError(f"Triton routing: {why}")
    if p.rows < num_experts + (1 if gated else 0):
        raise ValueError(f"Triton routing: {p.rows} router rows for {num_experts} experts"
                         + (" and the shared expert's gate" if gated else ""))
    width = top_k + shared
    dev = p.parts.device
    weights = torch.empty((t, width), dtype=torch.float32, device=dev)
    ids = torch.empty((t, width), dtype=torch.int32, device=dev)
    logits = torch.empty((t, p.rows), dtype=p.dtype, device=dev)
    if t:
        _topk_route_partials_kernel[(t,)](p.parts, t, logits, weights, ids, num_experts, p.rows, splits, K=top_k,
                                          BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(width),
                                          BLOCK_S=triton.next_power_of_2(splits),
                                          SOFTMAX=method == "softmax", RENORM=renormalize, SHARED=shared,
                                          GATED=gated, num_warps=4, **launch_kwargs(t),
                                          **({"LET_EARLY": True} if let_early else {}))
    return weights, ids, logits


class TritonTopkRouter:
    """A layer's router (installed by ``routing.FusedRouting``): softmax or Llama-4 routing through
    :func:`topk_route`. Steps of at most ``split_max_tokens`` tokens may also run the router's GEMM here
    (:meth:`partial_logits`, then :meth:`route_partials`)."""

    name = "triton_topk"
    appends_shared = True  # writes a fused shared expert's columns itself (``shared``, ``gated``)

    def __init__(self, cfg, split_max_tokens: int = 0):
        self.cfg = cfg
        self.split_max_tokens = min(split_max_tokens, ROUTER_MAX_TOKENS)

    @eager  # a custom kernel launch: torch.compile (torch_compile: true) runs it eagerly
    def __call__(self, logits: torch.Tensor, correction_bias: torch.Tensor | None = None, shared: int = 0,
                 gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        return topk_route(logits, c.method, c.top_k, c.renormalize, shared, gated)

    def takes_gemm(self, tokens: int, weight: torch.Tensor) -> bool:
        """Whether a step of ``tokens`` tokens runs the router's GEMM (``weight [N, K]``) as partial sums."""
        return (0 < tokens <= self.split_max_tokens and weight.dtype in (torch.bfloat16, torch.float16)
                and weight.shape[0] <= ROUTER_MAX_ROWS and weight.stride(1) == 1)

    @eager
    def partial_logits(self, x: torch.Tensor, weight: torch.Tensor) -> RouterPartials:
        return router_partials(x, weight)

    def takes_norm(self, tokens: int, weight: torch.Tensor) -> bool:
        """Whether a step of ``tokens`` tokens may also fold the post-attention norm into the partial sums
        (:meth:`add_norm_partial_logits`, ``router_fuse_norm``)."""
        return (tokens <= ROUTER_NORM_MAX_TOKENS and self.takes_gemm(tokens, weight)
                and weight.shape[1] <= ROUTER_NORM_MAX_HIDDEN)

    @eager
    def add_norm_partial_logits(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                                eps: float, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RouterPartials]:
        return add_norm_router_partials(x, residual, norm_weight, eps, weight)

    @eager
    def route_partials(self, p: RouterPartials, num_experts: int, shared: int = 0, gated: bool = False,
                       let_early: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cfg
        return topk_route_partials(p, num_experts, c.method, c.top_k, c.renormalize, shared, gated, let_early)
