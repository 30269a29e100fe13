"""Sampled and prompt log-probabilities match transformers' float32 log-softmax of the same random
checkpoint: values (to 1e-4), ranks and the top-N tokens, with the prompt cut into prefill chunks, for
greedy and sampled requests (the values come from the raw logits: temperature and top-k do not change
them), in vLLM's output shape."""
import pytest
import torch

from hf_models import hf_logits, make_checkpoint
from moeserve import LLM, SamplingParams
from moeserve.engine.outputs import Logprob

TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_lp")
    hf = make_checkpoint("qwen2_moe", path)
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_num_batched_tokens=16, page_size=4,
              num_kv_pages=200, max_model_len=128, max_num_seqs=4, enforce_eager=True)
    return hf, llm


def check_position(d: dict, target: int, ref_row: torch.Tensor, n: int) -> None:
    assert isinstance(d[target], Logprob)
    assert abs(d[target].logprob - ref_row[target].item()) < TOL
    assert d[target].rank == int((ref_row >= ref_row[target]).sum())
    top = torch.topk(ref_row, n)
    for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
        assert abs(d[tid].logprob - value) < TOL and d[tid].rank == rank
    assert len(d) in (n, n + 1)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_prompt_and_sampled_logprobs_match_transformers(setup, sampled):
    hf, llm = setup
    prompts = [[(7 * i + 3) % 256 for i in range(37)], [5, 9, 200, 17, 4, 4, 31]]  # 37 tokens: three chunks of 16
    params = SamplingParams(temperature=0.8 if sampled else 0.0, top_k=20 if sampled else 0, seed=1, max_tokens=6,
                            logprobs=4, prompt_logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        toks = out.outputs[0].token_ids
        ref = torch.log_softmax(hf_logits(hf, prompt + toks), dim=-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            check_position(out.prompt_logprobs[p], prompt[p], ref[p - 1], 3)
        assert len(out.outputs[0].logprobs) == len(toks) == 6
        for i, t in enumerate(toks):
            check_position(out.outputs[0].logprobs[i], t, ref[len(prompt) - 1 + i], 4)
            if not sampled:
                assert out.outputs[0].logprobs[i][t].rank == 1


def test_logprobs_zero_gives_the_sampled_token_only(setup):
    hf, llm = setup
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0, max_tokens=3, logprobs=0,
                                                                       ignore_eos=True))[0]
    assert [list(d) for d in out.outputs[0].logprobs] == [[t] for t in out.outputs[0].token_ids]
    assert out.prompt_logprobs is None
    plain = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0, max_tokens=3,
                                                                         ignore_eos=True))[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.gpu
def test_logprobs_on_the_gpu_through_cuda_graphs_match_transformers(tmp_path):
    """Decode steps replay CUDA graphs and the logprobs are copied to the host behind the step's event: in
    float32 (default GPU backends otherwise) the values match transformers to 2e-3 (TF32 matmuls), the greedy
    token has rank 1, and prompt scores come from the eager prefill path."""
    path = tmp_path / "qwen2_gpu"
    hf = make_checkpoint("qwen2_moe", path)
    llm = LLM(model=str(path), dtype="float32", device="cuda", max_num_batched_tokens=16, page_size=16,
              num_kv_pages=64, max_model_len=128, max_num_seqs=4)
    prompt = [(5 * i + 1) % 256 for i in range(30)]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, logprobs=2,
                                                                    prompt_logprobs=2, ignore_eos=True))[0]
    toks = out.outputs[0].token_ids
    ref = torch.log_softmax(hf_logits(hf, prompt + toks), dim=-1)
    for p in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[p][prompt[p]].logprob - ref[p - 1, prompt[p]].item()) < 2e-3
    for i, t in enumerate(toks):
        d = out.outputs[0].logprobs[i]
        assert d[t].rank == 1 and abs(d[t].logprob - ref[len(prompt) - 1 + i, t].item()) < 2e-3
