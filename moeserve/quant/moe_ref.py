"""The torch reference for block-FP8 experts: one expert at a time, with the numerics of the GPU kernels.

Activations are quantised 1x128 per token (the layer input once, the SwiGLU output of each expert before the
second GEMM), weights are dequantised per 128x128 block, products are taken in float32, and the two
intermediates (first-GEMM output, SwiGLU output) are rounded to the activation dtype as the fused kernels
store them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.quant.fp8 import block_dequant_fp8, per_token_group_dequant, per_token_group_quant_fp8


def fp8_expert_activations(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, inter: int,
                           topk_ids: torch.Tensor):
    """Per expert ``e`` that ``topk_ids`` picks on this rank: ``(e, token_idx, slot, act)``, where ``act`` is the
    SwiGLU output ``silu(G_e Q(x_t)) * U_e Q(x_t)`` of those tokens in ``x.dtype``, before its re-quantisation
    (the intermediates of :func:`fp8_moe_reference`)."""
    xq = per_token_group_dequant(*per_token_group_quant_fp8(x))
    ids = topk_ids.to(torch.int64)
    for e in ids.unique().tolist():
        if e < 0:  # an expert of another rank
            continue
        token_idx, slot = torch.where(ids == e)
        h = (xq[token_idx] @ block_dequant_fp8(w13[e], w13_scale[e]).t()).to(x.dtype).float()
        yield e, token_idx, slot, (F.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype)


def fp8_moe_reference(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``sum_j w[t,j] * W2[e] Q(silu(G_e Q(x_t)) * U_e Q(x_t))`` over ``e = ids[t,j]``, returned in ``x.dtype``.

    ``w13`` is e4m3 ``[E, 2I, H]`` (gate rows first) with scales ``[E, ceil(2I/128), ceil(H/128)]``; ``w2`` is
    e4m3 ``[E, H, I]`` with scales ``[E, ceil(H/128), ceil(I/128)]``; ``topk_weights`` ``[T, k]`` float32.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, token_idx, slot, act in fp8_expert_activations(x, w13, w13_scale, w2.shape[-1], topk_ids):
        actq = per_token_group_dequant(*per_token_group_quant_fp8(act))
        y = actq @ block_dequant_fp8(w2[e], w2_scale[e]).t()
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].float())
    return out.to(x.dtype)


def experts_fp8_reference(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer) -> torch.Tensor:
    """:func:`fp8_moe_reference` on a ``SparseMoE`` block's FP8 weights (``w13_order`` must be ``gate_up``)."""
    if layer.w13_order != "gate_up":
        raise ValueError("the FP8 MoE reference needs w13 in gate_up order; this layer was prepared for another "
                         "backend")
    return fp8_moe_reference(x, layer.w13, layer.w13_scale_inv, layer.w2, layer.w2_scale_inv, topk_weights, topk_ids)
