"""Qwen2-MoE (Qwen1.5-MoE-A2.7B): q/k/v biases, softmax top-k routing without renormalisation by
default, and a shared expert gated by ``sigmoid(x . w)``."""
from __future__ import annotations

from moeserve.models.arch import ArchConfig, eos_ids, num_experts, require, rope_scaling, rope_theta, sparse_layers
from moeserve.ops.moe.routing import RoutingConfig


def arch_config(hf: dict) -> ArchConfig:
    require(hf, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok",
            "moe_intermediate_size")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    layers = hf["num_hidden_layers"]
    return ArchConfig(
        model_type="qwen2_moe",
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=layers,
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads", heads), head_dim=head_dim,
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope_theta(hf), rotary_dim=head_dim,
        rope_scaling=rope_scaling(hf), qkv_bias=hf.get("qkv_bias", True), o_bias=False, qk_norm=False,
        dense_intermediate_size=hf.get("intermediate_size", 0),
        moe_intermediate_size=hf["moe_intermediate_size"], num_experts=num_experts(hf),
        routing=RoutingConfig("softmax", hf["num_experts_per_tok"], bool(hf.get("norm_topk_prob", False))),
        moe_layers=sparse_layers(hf, layers),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) or 0,
        shared_expert_gate=bool(hf.get("shared_expert_intermediate_size", 0)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), eos_token_ids=eos_ids(hf),
        initializer_range=hf.get("initializer_range", 0.02), torch_dtype=hf.get("torch_dtype", hf.get("dtype")),
    )
