"""Expert routing: which experts each token goes to, and with what weight (torch reference, any device).

Three schemes:
- ``softmax``: softmax over all experts, top-k, optionally renormalised over the k (Qwen, Mixtral).
- ``deepseek_v3``: sigmoid scores plus a per-expert correction bias choose the experts, limited to the
  best ``topk_group`` of ``n_group`` groups (a group scores the sum of its two best biased scores); the
  weights are the unbiased sigmoid scores of the chosen experts, renormalised, times
  ``routed_scaling_factor`` (DeepSeek-V3, GLM-4.5).
- ``llama4``: top-k on the raw logits; the weight is the sigmoid of the chosen logit (Llama 4).

All return ``(weights float32 [T, k], ids int32 [T, k])``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingConfig:
    method: str = "softmax"  # softmax | deepseek_v3 | llama4
    top_k: int = 2
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.method not in ("softmax", "deepseek_v3", "llama4"):
            raise ValueError(f"routing method {self.method!r} is not one of softmax, deepseek_v3, llama4")


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def deepseek_v3_topk(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                     topk_group: int, routed_scaling_factor: float, renormalize: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.sigmoid(logits.float())
    biased = scores + correction_bias.float()[None, :]
    t, e = biased.shape
    if n_group > 1:
        grouped = biased.view(t, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        keep_groups = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        expert_mask = group_mask[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)
        biased = biased.masked_fill(~expert_mask, float("-inf"))
    ids = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def llama4_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.sigmoid(values.float()), ids.to(torch.int32)


def select_experts(logits: torch.Tensor, cfg: RoutingConfig, correction_bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    if cfg.method == "softmax":
        return softmax_topk(logits, cfg.top_k, cfg.renormalize)
    if cfg.method == "deepseek_v3":
        if correction_bias is None:
            correction_bias = torch.zeros(logits.shape[-1], device=logits.device)
        return deepseek_v3_topk(logits, correction_bias, cfg.top_k, cfg.n_group, cfg.topk_group,
                                cfg.routed_scaling_factor, cfg.renormalize)
    return llama4_topk(logits, cfg.top_k)
