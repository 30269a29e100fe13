"""The torch reference for the expert computation: one expert at a time, as Hugging Face does it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.ops.interfaces import MoEBackend


def torch_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """``sum_j w[t,j] * w2[e] @ (silu(gate_e x) * up_e x)`` over the k experts ``e = ids[t,j]``.

    ``w13`` is ``[E, 2I, H]`` with the gate rows first; ``w2`` is ``[E, H, I]``. The routing weights are
    cast to the activation dtype before use, as Hugging Face's MoE blocks do. Negative ids (experts held by
    other ranks) contribute nothing.
    """
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    ids = topk_ids.to(torch.int64)
    for e in ids.unique().tolist():
        if e < 0:
            continue
        token_idx, slot = torch.where(ids == e)
        h = F.linear(x[token_idx], w13[e])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        h = F.linear(h, w2[e])
        h = h * topk_weights[token_idx, slot, None].to(h.dtype)
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


class TorchMoE(MoEBackend):
    name = "torch"
    fuses_norm = True  # the reference of the Triton MoE's combine with the next norm (AddNorm.apply)

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer,
                shared=None, add_norm=None) -> torch.Tensor:
        out = torch_moe(x, layer.w13, layer.w2, topk_weights, topk_ids)
        out = out if shared is None else shared.add_to(out)
        return out if add_norm is None else add_norm.apply(out)
