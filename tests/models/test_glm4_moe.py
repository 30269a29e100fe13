"""GLM-4.5-style MoE (``glm4_moe``) against transformers' ``Glm4MoeForCausalLM`` on small random checkpoints:
partial neox-style RoPE, q/k/v biases, q/k norm, grouped sigmoid routing with correction bias and
``routed_scaling_factor``, an ungated shared expert, a leading dense layer.

Criterion (float32 on CPU): greedy tokens identical; every sampled row's logits within 2e-4 absolute of
transformers' (summation order only), under chunked prefill, mixed steps and preemption.
"""
import pytest
import torch

from hf_models import hf_greedy, hf_logits, make_checkpoint
from moeserve import LLM, SamplingParams
from moeserve.config import resolve_model_source
from moeserve.models import arch_from_hf, checkpoint_name
from moeserve.ops.moe.routing import RoutingConfig
from lockstep import random_prompts, run_recording_logits
from test_hf_equivalence import LOGITS_ATOL, MAX_TOKENS, PROMPT_LENS


PLAIN = dict(n_group=1, topk_group=1, use_qk_norm=False, attention_bias=False, partial_rotary_factor=0.25,
             routed_scaling_factor=1.0)


@pytest.mark.parametrize("fuse_norm", [False, True], ids=["", "moe_fuse_norm"])
def test_greedy_tokens_and_logits_match_transformers(tmp_path, fuse_norm):
    """``moe_fuse_norm``: the MoE blocks (not the leading dense layer) end in the combine with the next norm."""
    hf = make_checkpoint("glm4_moe", tmp_path)
    assert hf.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0
    prompt_ids = random_prompts(hf.config.vocab_size, 2, PROMPT_LENS)
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompt_ids]
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=16, page_size=4,
              num_kv_pages=25, max_model_len=96, max_num_seqs=4, moe_fuse_norm=fuse_norm)
    runner = llm.engine.runner
    assert runner.arch.rotary_dim == 8
    assert [type(layer.mlp).__name__ for layer in runner.model.layers] == ["DenseMLP", "SparseMoE", "SparseMoE"]
    assert [layer.mlp.takes_norm(1) for layer in runner.model.layers[1:]] == [fuse_norm] * 2
    seqs, rows = run_recording_logits(llm, prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                      ignore_eos=True))
    assert [s.output_token_ids for s in seqs] == expected
    assert llm.engine.stats["prefill_chunks"] > 0 and llm.engine.scheduler.num_preemptions > 0
    for s, p, toks in zip(seqs, prompt_ids, expected):
        ref = hf_logits(hf, p + toks)
        for pos in range(len(p) - 1, len(p) + MAX_TOKENS - 1):
            torch.testing.assert_close(rows[(s.request_id, pos)], ref[pos], atol=LOGITS_ATOL, rtol=0)


def test_routing_matches_transformers_router(tmp_path):
    """The MoE block's routing (float32 logits, bias, groups, scaling) picks transformers' experts and weights."""
    hf = make_checkpoint("glm4_moe", tmp_path, seed=4)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2)
    block = llm.engine.runner.model.layers[2].mlp
    x = torch.randn(50, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    _, w_ref, ids_ref = hf.model.layers[2].mlp.gate(x)
    w, ids, gate_logit = block.route(x)
    assert gate_logit is None  # GLM-4.5 has no shared-expert gate
    assert block.routing_impl == "torch"
    order, order_ref = ids.long().sort(-1), ids_ref.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices), rtol=1e-6, atol=1e-6)


def test_generate_api_matches_transformers(tmp_path):
    """Single group, no q/k norm, no biases, a quarter of each head rotated."""
    hf = make_checkpoint("glm4_moe", tmp_path, seed=3, **PLAIN)
    prompt_ids = random_prompts(hf.config.vocab_size, 7, PROMPT_LENS)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=32, page_size=8,
              max_model_len=128, max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert llm.engine.runner.arch.rotary_dim == 4
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompt_ids]


def test_glm_air_preset_shape():
    arch = arch_from_hf(resolve_model_source("glm-4.5-air").config)
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4096, 46, 96, 8, 128)
    assert arch.rotary_dim == 64 and arch.rope_theta == 1e6 and arch.qkv_bias and not arch.qk_norm
    assert arch.moe_layers == (False,) + (True,) * 45
    assert (arch.num_experts, arch.top_k, arch.moe_intermediate_size, arch.dense_intermediate_size) == (128, 8, 1408, 10944)
    assert arch.shared_expert_intermediate_size == 1408 and not arch.shared_expert_gate
    r = arch.routing
    assert (r.method, r.n_group, r.topk_group, r.routed_scaling_factor, r.renormalize) == ("deepseek_v3", 1, 1, 1.0, True)
    assert arch.router_fp32 and arch.routing_correction_bias and arch.vocab_size == 151552


def test_checkpoint_names_and_config_errors():
    assert (checkpoint_name("glm4_moe", "model.layers.3.mlp.shared_experts.up_proj.weight")
            == "model.layers.3.mlp.shared_expert.up_proj.weight")
    base = resolve_model_source("glm-4.5-air").config
    with pytest.raises(ValueError, match=r"n_routed_experts \(128\) is not divisible by n_group \(3\)"):
        arch_from_hf({**base, "n_group": 3})
    with pytest.raises(ValueError, match="partial_rotary_factor gives rotary dim 0"):
        arch_from_hf({**base, "partial_rotary_factor": 0.0})
    no_factor = {k: v for k, v in base.items() if k != "partial_rotary_factor"}
    assert arch_from_hf(no_factor).rotary_dim == 64  # transformers' default of 0.5


def test_fused_routing_limits():
    """Which DeepSeek-V3 routings the GPU backends hand to FlashInfer's fused kernel (decided without a GPU)."""
    from moeserve.ops.moe import routing
    cuda = (9, 0)
    ok = [(RoutingConfig("deepseek_v3", 8, True, 1, 1, 1.0), 128),  # GLM-4.5-Air
          (RoutingConfig("deepseek_v3", 8, True, 8, 4, 2.5), 256),  # DeepSeek-V3
          (RoutingConfig("deepseek_v3", 8, True, 1, 1, 2.5), 160)]
    for cfg, experts in ok:
        assert routing.fused_deepseek_unsupported(cfg, experts, cuda) is None, (cfg, experts)
    refused = [(RoutingConfig("deepseek_v3", 8, False), 128, "always renormalises"),
               (RoutingConfig("deepseek_v3", 9, True), 128, "top_k 9 > 8"),
               (RoutingConfig("deepseek_v3", 8, True, 16, 4), 256, "exceeds the kernel"),
               (RoutingConfig("deepseek_v3", 8, True, 8, 5), 256, "exceeds the kernel"),
               (RoutingConfig("deepseek_v3", 8, True, 3, 1), 128, "do not fit"),
               (RoutingConfig("deepseek_v3", 8, True), 512, "max 384"),
               (RoutingConfig("softmax", 8, True), 128, "routing is softmax")]
    for cfg, experts, why in refused:
        assert why in routing.fused_deepseek_unsupported(cfg, experts, cuda)
    assert "not on sm80" in routing.fused_deepseek_unsupported(ok[0][0], 128, (8, 0))
    assert routing.fused_deepseek_unsupported(ok[0][0], 128, None) == "needs a CUDA GPU"
