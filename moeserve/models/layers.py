"""The building blocks every MoE family shares: attention, dense MLP, sparse MoE block, decoder layer, LM.

Each block computes through the operator backends in ``Ops`` and lists the checkpoint tensors it
expects (Hugging Face names) with where each one lands, so the weight loader needs no per-model code.
q/k/v are merged into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (gate rows first) so each is
one GEMM; the experts of a layer are stacked into ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from moeserve.models.arch import ArchConfig
from moeserve.ops.moe.routing import select_experts


@dataclass
class Ops:
    """The backend instances one engine uses; ``attention`` is set once the KV cache exists."""

    linear: object
    norm: object
    activation: object
    moe: object
    rope_cls: type
    attention: object = None
    names: dict[str, str] = field(default_factory=dict)


@dataclass
class Entry:
    """One checkpoint tensor: where it goes (``param[index]``) and which other names it stands for."""

    param: torch.Tensor
    index: tuple = ()
    covers: tuple[str, ...] = ()


def _param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, ops: Ops, in_features: int, out_features: int, bias: bool, dtype, device):
        super().__init__()
        self.ops = ops
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, ops: Ops, arch: ArchConfig, layer_idx: int, rope, dtype, device):
        super().__init__()
        self.ops, self.layer_idx, self.rope = ops, layer_idx, rope
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.eps = arch.rms_norm_eps
        self.qkv_proj = Linear(ops, arch.hidden_size, self.q_size + 2 * self.kv_size, arch.qkv_bias, dtype, device)
        self.o_proj = Linear(ops, self.q_size, arch.hidden_size, arch.o_bias, dtype, device)
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:
            self.q_norm = _param((arch.head_dim,), dtype, device)
            self.k_norm = _param((arch.head_dim,), dtype, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.ops.norm.rmsnorm(q.reshape(t, self.num_heads, self.head_dim), self.q_norm, self.eps).view(t, -1)
            k = self.ops.norm.rmsnorm(k.reshape(t, self.num_kv_heads, self.head_dim), self.k_norm, self.eps).view(t, -1)
        q, k = self.rope.apply(positions, q, k)
        o = self.ops.attention.forward(
            self.layer_idx, q.reshape(t, self.num_heads, self.head_dim).contiguous(),
            k.view(t, self.num_kv_heads, self.head_dim), v.view(t, self.num_kv_heads, self.head_dim))
        return self.o_proj(o.view(t, self.q_size))

    def entries(self, prefix: str) -> dict[str, Entry]:
        w, qs, ks = self.qkv_proj.weight, self.q_size, self.kv_size
        e = {
            f"{prefix}.q_proj.weight": Entry(w, (slice(0, qs),)),
            f"{prefix}.k_proj.weight": Entry(w, (slice(qs, qs + ks),)),
            f"{prefix}.v_proj.weight": Entry(w, (slice(qs + ks, qs + 2 * ks),)),
            f"{prefix}.o_proj.weight": Entry(self.o_proj.weight),
        }
        if self.qkv_proj.bias is not None:
            b = self.qkv_proj.bias
            e[f"{prefix}.q_proj.bias"] = Entry(b, (slice(0, qs),))
            e[f"{prefix}.k_proj.bias"] = Entry(b, (slice(qs, qs + ks),))
            e[f"{prefix}.v_proj.bias"] = Entry(b, (slice(qs + ks, qs + 2 * ks),))
        if self.o_proj.bias is not None:
            e[f"{prefix}.o_proj.bias"] = Entry(self.o_proj.bias)
        if self.qk_norm:
            e[f"{prefix}.q_norm.weight"] = Entry(self.q_norm)
            e[f"{prefix}.k_norm.weight"] = Entry(self.k_norm)
        return e


class DenseMLP(nn.Module):
    def __init__(self, ops: Ops, hidden: int, intermediate: int, dtype, device):
        super().__init__()
        self.ops, self.intermediate = ops, intermediate
        self.gate_up_proj = Linear(ops, hidden, 2 * intermediate, False, dtype, device)
        self.down_proj = Linear(ops, intermediate, hidden, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.activation.silu_and_mul(self.gate_up_proj(x)))

    def entries(self, prefix: str) -> dict[str, Entry]:
        w, i = self.gate_up_proj.weight, self.intermediate
        return {
            f"{prefix}.gate_proj.weight": Entry(w, (slice(0, i),)),
            f"{prefix}.up_proj.weight": Entry(w, (slice(i, 2 * i),)),
            f"{prefix}.down_proj.weight": Entry(self.down_proj.weight),
        }


class SparseMoE(nn.Module):
    """Router, routed experts, and an optional (optionally gated) shared expert."""

    def __init__(self, ops: Ops, arch: ArchConfig, dtype, device):
        super().__init__()
        self.ops, self.routing = ops, arch.routing
        self.num_experts, self.top_k = arch.num_experts, arch.routing.top_k
        h, i, e = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts
        self.intermediate = i
        self.gate = Linear(ops, h, e, False, dtype, device)
        self.w13 = _param((e, 2 * i, h), dtype, device)
        self.w2 = _param((e, h, i), dtype, device)
        self.w13_order = "gate_up"
        self.correction_bias = _param((e,), torch.float32, device) if arch.routing_correction_bias else None
        self.shared_expert = None
        self.shared_expert_gate = None
        if arch.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(ops, h, arch.shared_expert_intermediate_size, dtype, device)
            if arch.shared_expert_gate:
                self.shared_expert_gate = Linear(ops, h, 1, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, ids = select_experts(logits, self.routing, self.correction_bias)
        out = self.ops.moe.experts(x, weights, ids, self)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def entries(self, prefix: str) -> dict[str, Entry]:
        i = self.intermediate
        e: dict[str, Entry] = {f"{prefix}.gate.weight": Entry(self.gate.weight)}
        per_expert_13, per_expert_2 = [], []
        for x in range(self.num_experts):
            p = f"{prefix}.experts.{x}"
            e[f"{p}.gate_proj.weight"] = Entry(self.w13, (x, slice(0, i)))
            e[f"{p}.up_proj.weight"] = Entry(self.w13, (x, slice(i, 2 * i)))
            e[f"{p}.down_proj.weight"] = Entry(self.w2, (x,))
            per_expert_13 += [f"{p}.gate_proj.weight", f"{p}.up_proj.weight"]
            per_expert_2.append(f"{p}.down_proj.weight")
        # Stacked layouts (transformers 5 in memory, some exporters): one tensor for all experts.
        e[f"{prefix}.experts.gate_up_proj"] = Entry(self.w13, (), tuple(per_expert_13))
        e[f"{prefix}.experts.down_proj"] = Entry(self.w2, (), tuple(per_expert_2))
        if self.correction_bias is not None:
            e[f"{prefix}.gate.e_score_correction_bias"] = Entry(self.correction_bias)
        if self.shared_expert is not None:
            e.update(self.shared_expert.entries(f"{prefix}.shared_expert"))
        if self.shared_expert_gate is not None:
            e[f"{prefix}.shared_expert_gate.weight"] = Entry(self.shared_expert_gate.weight)
        return e


class DecoderLayer(nn.Module):
    def __init__(self, ops: Ops, arch: ArchConfig, layer_idx: int, rope, dtype, device):
        super().__init__()
        self.ops, self.eps = ops, arch.rms_norm_eps
        self.input_layernorm = _param((arch.hidden_size,), dtype, device)
        self.post_attention_layernorm = _param((arch.hidden_size,), dtype, device)
        self.self_attn = Attention(ops, arch, layer_idx, rope, dtype, device)
        if arch.layer_is_moe(layer_idx):
            self.mlp = SparseMoE(ops, arch, dtype, device)
        else:
            self.mlp = DenseMLP(ops, arch.hidden_size, arch.dense_intermediate_size, dtype, device)

    def forward(self, positions, hidden, residual):
        norm = self.ops.norm
        if residual is None:
            residual = hidden
            h = norm.rmsnorm(hidden, self.input_layernorm, self.eps)
        else:
            h, residual = norm.add_rmsnorm(hidden, residual, self.input_layernorm, self.eps)
        h = self.self_attn(positions, h)
        h, residual = norm.add_rmsnorm(h, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(h), residual

    def entries(self, prefix: str) -> dict[str, Entry]:
        e = {f"{prefix}.input_layernorm.weight": Entry(self.input_layernorm),
             f"{prefix}.post_attention_layernorm.weight": Entry(self.post_attention_layernorm)}
        e.update(self.self_attn.entries(f"{prefix}.self_attn"))
        e.update(self.mlp.entries(f"{prefix}.mlp"))
        return e


class MoECausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head, over a flat batch of tokens."""

    def __init__(self, arch: ArchConfig, ops: Ops, dtype: torch.dtype, device: torch.device):
        super().__init__()
        from moeserve.ops.basic import rope_cos_sin_cache
        self.arch, self.ops = arch, ops
        self.embed_tokens = _param((arch.vocab_size, arch.hidden_size), dtype, device)
        cache = rope_cos_sin_cache(arch.rotary_dim, arch.max_position_embeddings, arch.rope_theta,
                                   arch.rope_scaling, device)
        self.rope = ops.rope_cls(arch.head_dim, arch.rotary_dim, cache)
        self.layers = nn.ModuleList(DecoderLayer(ops, arch, i, self.rope, dtype, device)
                                    for i in range(arch.num_layers))
        self.norm = _param((arch.hidden_size,), dtype, device)
        self.lm_head = self.embed_tokens if arch.tie_word_embeddings else _param(
            (arch.vocab_size, arch.hidden_size), dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.ops.norm.add_rmsnorm(hidden, residual, self.norm, self.arch.rms_norm_eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()

    def checkpoint_entries(self) -> dict[str, Entry]:
        e = {"model.embed_tokens.weight": Entry(self.embed_tokens), "model.norm.weight": Entry(self.norm)}
        if not self.arch.tie_word_embeddings:
            e["lm_head.weight"] = Entry(self.lm_head)
        for i, layer in enumerate(self.layers):
            e.update(layer.entries(f"model.layers.{i}"))
        return e

    def moe_blocks(self) -> list[SparseMoE]:
        blocks = [getattr(layer.mlp, "_orig_mod", layer.mlp) for layer in self.layers]
        return [b for b in blocks if isinstance(b, SparseMoE)]
