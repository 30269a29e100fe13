"""``torch_compile: true`` compiles each layer's MLP/MoE block; its logits must match eager (CPU, float32,
atol 1e-4) and so must its greedy tokens."""
import pytest
import torch

from moeserve import LLM, SamplingParams
from test_hf_equivalence import run_recording_logits


def test_compiled_mlps_match_eager():
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(1, n)) for n in (5, 30, 12)]
    eager_seqs, eager_rows = run_recording_logits(LLM(model="tiny", max_num_batched_tokens=24), prompts, params)
    llm = LLM(model="tiny", max_num_batched_tokens=24, torch_compile=True)
    assert all(hasattr(layer.mlp, "_orig_mod") for layer in llm.engine.runner.model.layers)
    seqs, rows = run_recording_logits(llm, prompts, params)
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in eager_seqs]
    assert rows.keys() == eager_rows.keys()  # both engines number their requests from req-0
    for key, row in rows.items():
        torch.testing.assert_close(row, eager_rows[key], atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_compiled_mlps_with_the_triton_moe_match_eager_on_the_gpu():
    """On the GPU the MoE experts are a Triton kernel: torch.compile must leave its launch to run eagerly
    (``torch.compiler.disable``) and compile the rest of the block. First-token logits within bf16 tolerance
    (relative Frobenius error below 2e-2)."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [list(range(1, n)) for n in (5, 30, 12)]
    # a small KV pool: both engines are alive at once, and by default each would reserve most of the GPU
    kw = dict(model="tiny", device="cuda", dtype="bfloat16", max_num_batched_tokens=64, num_kv_pages=64,
              max_model_len=256, backends={"moe": "triton", "attention": "torch"}, enforce_eager=True)
    _, eager_rows = run_recording_logits(LLM(**kw), prompts, params)
    llm = LLM(**kw, torch_compile=True)
    assert llm.engine.runner.ops.moe.name == "triton"
    _, rows = run_recording_logits(llm, prompts, params)
    first = [k for k in eager_rows if k[1] == min(p for r, p in eager_rows if r == k[0])]
    assert len(first) == len(prompts)
    for key in first:
        err = float((rows[key].float() - eager_rows[key].float()).norm() / eager_rows[key].float().norm())
        assert err < 2e-2, (key, err)
