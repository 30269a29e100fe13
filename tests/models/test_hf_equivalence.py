"""Whole-model checks: moeserve loads transformers' own Qwen2-MoE and Qwen3-MoE checkpoints and produces
the same greedy tokens and (within a stated tolerance) the same logits, under chunked prefill, mixed
steps and preemption."""
import pytest
import torch

from hf_models import hf_greedy, hf_logits, make_checkpoint
from lockstep import random_prompts, run_recording_logits
from moeserve import LLM, SamplingParams

PROMPT_LENS = [3, 17, 40, 65, 9]
MAX_TOKENS = 12
LOGITS_ATOL = 2e-4  # float32 on CPU: differences come only from summation order


@pytest.mark.parametrize("fuse_norm", [0, 1 << 20, 1], ids=["", "moe_fuse_norm", "moe_fuse_norm_max_tokens-1"])
@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_greedy_tokens_and_logits_match_transformers(tmp_path, kind, fuse_norm):
    """``moe_fuse_norm``: every MoE block ends in its combine adding to the residual and applying the next
    layer's input norm (the last one the final norm), the torch reference of the Triton kernel;
    ``moe_fuse_norm_max_tokens: 1``: only one-token steps do (the others run the norm as its own op)."""
    hf = make_checkpoint(kind, tmp_path)
    prompt_ids = random_prompts(hf.config.vocab_size, 1, PROMPT_LENS)
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompt_ids]

    # A small token budget forces chunked prefill and mixed steps; 24 usable pages of 4 tokens hold
    # fewer tokens (96) than four running requests need together, which forces preemption.
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=16, page_size=4,
              num_kv_pages=25, max_model_len=96, max_num_seqs=4, moe_fuse_norm=fuse_norm == 1 << 20,
              moe_fuse_norm_max_tokens=fuse_norm if fuse_norm == 1 else 0)
    moe = [layer.mlp for layer in llm.engine.runner.model.layers if hasattr(layer.mlp, "takes_norm")]
    assert moe and all(m.takes_norm(1) == (fuse_norm > 0) and m.takes_norm(2) == (fuse_norm > 1) for m in moe)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seqs, rows = run_recording_logits(llm, prompt_ids, params)

    got = [s.output_token_ids for s in seqs]
    assert got == expected
    stats = llm.engine.stats
    assert stats["prefill_chunks"] > 0, "the token budget should have split prompts into chunks"
    assert stats["mixed_steps"] > 0, "some step should have mixed prefill chunks with decodes"
    assert llm.engine.scheduler.num_preemptions > 0, "the small page pool should have forced preemption"
    assert llm.engine.pool.num_free == llm.engine.pool.capacity

    for s, p, toks in zip(seqs, prompt_ids, expected):
        ref = hf_logits(hf, p + toks)
        for pos in range(len(p) - 1, len(p) + MAX_TOKENS - 1):
            torch.testing.assert_close(rows[(s.request_id, pos)], ref[pos], atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_generate_api_matches_transformers(tmp_path, kind):
    hf = make_checkpoint(kind, tmp_path, seed=3)
    prompt_ids = random_prompts(hf.config.vocab_size, 5, PROMPT_LENS)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=32, page_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompt_ids]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
