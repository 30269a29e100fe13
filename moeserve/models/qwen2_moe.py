"""Qwen2-MoE (Qwen1.5-MoE-A2.7B): q/k/v biases, softmax top-k routing without renormalisation by
default, and a shared expert gated by ``sigmoid(x . w)``."""
from __future__ import annotations

from moeserve.models.arch import ArchConfig, common_fields, sparse_layers
from moeserve.ops.moe.routing_config import RoutingConfig


def arch_config(hf: dict) -> ArchConfig:
    base = common_fields(hf, "qwen2_moe", max_position_embeddings=32768, rms_norm_eps=1e-6)
    return ArchConfig(
        **base, rotary_dim=base["head_dim"], qkv_bias=hf.get("qkv_bias", True), o_bias=False, qk_norm=False,
        routing=RoutingConfig("softmax", hf["num_experts_per_tok"], bool(hf.get("norm_topk_prob", False))),
        moe_layers=sparse_layers(hf, base["num_layers"]),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) or 0,
        shared_expert_gate=bool(hf.get("shared_expert_intermediate_size", 0)),
    )
