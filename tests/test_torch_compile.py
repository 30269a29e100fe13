"""``torch_compile: true`` compiles each layer's MLP/MoE block; its logits must match eager (CPU, float32,
atol 1e-4) and so must its greedy tokens."""
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
