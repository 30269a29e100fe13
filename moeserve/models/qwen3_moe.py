"""Qwen3-MoE (Qwen3-30B-A3B): per-head q/k RMSNorm, GQA, no biases, softmax top-k routing renormalised
over the chosen experts (``norm_topk_prob``), no shared expert."""
from __future__ import annotations

from moeserve.models.arch import ArchConfig, common_fields, sparse_layers
from moeserve.ops.moe.routing_config import RoutingConfig


def arch_config(hf: dict) -> ArchConfig:
    base = common_fields(hf, "qwen3_moe", max_position_embeddings=40960, rms_norm_eps=1e-6)
    bias = bool(hf.get("attention_bias", False))
    return ArchConfig(
        **base, rotary_dim=base["head_dim"], qkv_bias=bias, o_bias=bias, qk_norm=True,
        routing=RoutingConfig("softmax", hf["num_experts_per_tok"], bool(hf.get("norm_topk_prob", True))),
        moe_layers=sparse_layers(hf, base["num_layers"]),
    )
