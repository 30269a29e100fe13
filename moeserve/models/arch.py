"""An architecture description normalised from a Hugging Face ``config.json``.

Each model family's module turns its HF config into an ``ArchConfig``; the shared layers in
``moeserve.models.layers`` build the network from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.ops.moe.routing_config import RoutingConfig


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    rope_scaling: dict | None
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    dense_intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    routing: RoutingConfig
    moe_layers: tuple[bool, ...]  # per layer: sparse MoE block (True) or dense MLP (False)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE gates the shared expert with sigmoid(x . w)
    routing_correction_bias: bool = False
    router_fp32: bool = False  # router logits computed in float32 (GLM-4.5 / DeepSeek-V3 style routers)
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    initializer_range: float = 0.02
    torch_dtype: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    def layer_is_moe(self, i: int) -> bool:
        return self.moe_layers[i]


def eos_ids(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def rope_theta(hf: dict) -> float:
    if "rope_theta" in hf and hf["rope_theta"] is not None:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def rope_scaling(hf: dict) -> dict | None:
    s = hf.get("rope_scaling")
    if s is None:
        params = hf.get("rope_parameters") or {}
        if params.get("rope_type", "default") != "default":
            s = params
    return s


def partial_rotary_factor(hf: dict, default: float = 1.0) -> float:
    """The fraction of each head that RoPE rotates (``partial_rotary_factor``, top level or in ``rope_parameters``)."""
    if hf.get("partial_rotary_factor") is not None:
        return float(hf["partial_rotary_factor"])
    params = hf.get("rope_parameters") or {}
    if params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    return default


def num_experts(hf: dict) -> int:
    """Routed experts; transformers 5 writes ``num_local_experts`` where older configs say ``num_experts``."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf.get(key) is not None:
            return int(hf[key])
    raise ValueError(f"config.json ({hf.get('model_type')}) lacks the number of experts (num_experts)")


def sparse_layers(hf: dict, num_layers: int, first_dense: int = 0) -> tuple[bool, ...]:
    """Which layers are MoE: HF's ``mlp_only_layers`` / ``decoder_sparse_step`` / ``first_k_dense_replace`` rules."""
    mlp_only = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    n_exp = num_experts(hf)
    return tuple(i not in mlp_only and n_exp > 0 and (i + 1) % step == 0 and i >= first_dense
                 for i in range(num_layers))


def common_fields(hf: dict, model_type: str, max_position_embeddings: int, rms_norm_eps: float) -> dict:
    """The ``ArchConfig`` fields every family reads the same way from its HF config (the two defaults differ
    by family); a family adds the rest (rotary dim, biases, norms, routing, MoE layout)."""
    require(hf, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok",
            "moe_intermediate_size")
    heads = hf["num_attention_heads"]
    return dict(
        model_type=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_position_embeddings=hf.get("max_position_embeddings", max_position_embeddings),
        rms_norm_eps=hf.get("rms_norm_eps", rms_norm_eps), rope_theta=rope_theta(hf), rope_scaling=rope_scaling(hf),
        dense_intermediate_size=hf.get("intermediate_size", 0), moe_intermediate_size=hf["moe_intermediate_size"],
        num_experts=num_experts(hf), tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids(hf), initializer_range=hf.get("initializer_range", 0.02),
        torch_dtype=hf.get("torch_dtype", hf.get("dtype")),
    )


def require(hf: dict, *keys: str):
    missing = [k for k in keys if k not in hf]
    if missing:
        raise ValueError(f"config.json ({hf.get('model_type')}) lacks required field(s): {', '.join(missing)}")
