"""GLM-4.5 / GLM-4.5-Air (``glm4_moe``): GQA attention with q/k/v biases and optional per-head q/k RMSNorm,
partial rotary embeddings (neox-style rotate-half over the first ``head_dim * partial_rotary_factor``
dims, as transformers' ``apply_rotary_pos_emb`` does), DeepSeek-V3 routing (sigmoid scores plus
``e_score_correction_bias``, ``n_group``/``topk_group`` group limits, ``routed_scaling_factor``) computed
in float32, ``n_shared_experts`` ungated shared experts, and dense MLPs in the first
``first_k_dense_replace`` layers.

Checkpoint names follow transformers (``mlp.shared_experts.*``); the multi-token-prediction layer that
full checkpoints carry after the last decoder layer is not used.
"""
from __future__ import annotations

from moeserve.models.arch import ArchConfig, common_fields, partial_rotary_factor, sparse_layers
from moeserve.ops.moe.routing_config import RoutingConfig

# transformers' Glm4MoeConfig fills partial_rotary_factor with 0.5 when a config leaves it out.
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def arch_config(hf: dict) -> ArchConfig:
    base = common_fields(hf, "glm4_moe", max_position_embeddings=131072, rms_norm_eps=1e-5)
    head_dim, experts = base["head_dim"], base["num_experts"]
    rotary_dim = int(head_dim * partial_rotary_factor(hf, DEFAULT_PARTIAL_ROTARY_FACTOR))
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"config.json (glm4_moe): partial_rotary_factor gives rotary dim {rotary_dim}; it must be an "
                         f"even number in (0, head_dim={head_dim}]")
    n_group = int(hf.get("n_group", 1) or 1)
    topk_group = int(hf.get("topk_group", 1) or 1)
    if experts % n_group:
        raise ValueError(f"config.json (glm4_moe): n_routed_experts ({experts}) is not divisible by n_group "
                         f"({n_group})")
    return ArchConfig(
        **base, rotary_dim=rotary_dim, qkv_bias=bool(hf.get("attention_bias", False)), o_bias=False,
        qk_norm=bool(hf.get("use_qk_norm", False)),
        routing=RoutingConfig("deepseek_v3", hf["num_experts_per_tok"], bool(hf.get("norm_topk_prob", True)),
                              n_group, topk_group, float(hf.get("routed_scaling_factor", 1.0))),
        moe_layers=sparse_layers(hf, base["num_layers"], first_dense=int(hf.get("first_k_dense_replace", 1))),
        shared_expert_intermediate_size=hf["moe_intermediate_size"] * int(hf.get("n_shared_experts", 0) or 0),
        shared_expert_gate=False, routing_correction_bias=True, router_fp32=True,
    )


def rename(name: str) -> str:
    """transformers' ``mlp.shared_experts.*`` is moeserve's ``mlp.shared_expert.*``."""
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


def export_name(name: str) -> str:
    return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
