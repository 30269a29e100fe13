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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.ops.eager import eager

MAX_EXPERTS = 4096
MAX_TOPK = 64
METHODS = ("softmax", "llama4")


@triton.jit
def _topk_route_kernel(logits_ptr, stride_t, weights_ptr, ids_ptr, E, K: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_K: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr,
                       SHARED: tl.constexpr = 0, GATED: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + t * stride_t + offs, mask=valid, other=float("-inf")).to(tl.float32)
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
            shared_w = tl.sigmoid(tl.load(logits_ptr + t * stride_t + E).to(tl.float32))
        else:
            shared_w = 1.0
        is_shared = (slots >= K) & (slots < K + SHARED)
        w = tl.where(is_shared, shared_w, w)
        ids = tl.where(is_shared, E + slots - K, ids)
    tl.store(weights_ptr + t * (K + SHARED) + slots, w, mask=slots < K + SHARED)
    tl.store(ids_ptr + t * (K + SHARED) + slots, ids, mask=slots < K + SHARED)


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
                                 RENORM=renormalize, SHARED=shared, GATED=gated, num_warps=1 if block_e <= 128 else 4)
    return weights, ids


class TritonTopkRouter:
    """A layer's router (installed by ``routing.FusedRouting``): softmax or Llama-4 routing through
    :func:`topk_route`."""

    name = "triton_topk"
    appends_shared = True  # writes a fused shared expert's columns itself (``shared``, ``gated``)

    def __init__(self, cfg):
        self.cfg = cfg

    @eager  # a custom kernel launch: torch.compile (torch_compile: true) runs it eagerly
    def __call__(self, logits: torch.Tensor, correction_bias: torch.Tensor | None = None, shared: int = 0,
                 gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        return topk_route(logits, c.method, c.top_k, c.renormalize, shared, gated)
