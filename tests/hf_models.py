"""Small random Hugging Face MoE checkpoints, written with transformers' own classes, for the tests; and moeserve's
model built on a plan's backends (:func:`plan_model`)."""
from __future__ import annotations

import torch

QWEN2_MOE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    shared_expert_intermediate_size=80, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
    max_position_embeddings=512, initializer_range=0.1, rope_theta=10000.0,
)
QWEN3_MOE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
    norm_topk_prob=True, max_position_embeddings=512, initializer_range=0.1, rope_theta=10000.0,
)

# GLM-4.5 style: partial RoPE, q/k/v biases, q/k norm, grouped sigmoid routing with a correction bias,
# a shared expert and one leading dense layer.
GLM4_MOE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=1, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
    max_position_embeddings=512, initializer_range=0.1, rope_theta=10000.0,
)


def make_checkpoint(kind: str, path, seed: int = 0, **overrides):
    """Save a random ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM`` or ``Glm4MoeForCausalLM`` to ``path``;
    return the HF model. GLM's routing correction biases are drawn at random (transformers zeroes them)."""
    import transformers
    torch.manual_seed(seed)
    if kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**{**QWEN2_MOE, **overrides})
        model = transformers.Qwen2MoeForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**{**QWEN3_MOE, **overrides})
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif kind == "glm4_moe":
        cfg = transformers.Glm4MoeConfig(**{**GLM4_MOE, **overrides})
        model = transformers.Glm4MoeForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None and hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.normal_(0.0, 0.05)
    else:
        raise ValueError(kind)
    model = model.float().eval()
    model.save_pretrained(path)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         attention_mask=torch.ones_like(ids), pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0].float()


def plan_model(plan, linear=None):
    """moeserve's ``MoECausalLM`` for ``plan`` (its rank, on its device) on the plan's backends, ``linear`` in place
    of the plan's linear backend when given; no engine, no process group."""
    from moeserve.models.layers import MoECausalLM, Ops
    cls, dev = plan.backend_class, plan.device
    ops = Ops(linear=linear or cls("linear")(dev, plan.dtype), norm=cls("norm")(), activation=cls("activation")(),
              moe=cls("moe")(dev, plan.dtype), rope_cls=cls("rope"), parallel=plan.parallel)
    return MoECausalLM(plan.arch, ops, plan.dtype, dev)
