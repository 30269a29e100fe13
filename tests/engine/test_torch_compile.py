"""``torch_compile: true`` compiles each layer's MLP/MoE block; its logits must match eager (CPU, float32,
atol 1e-4) and so must its greedy tokens."""
import pytest
import torch

from moeserve import LLM, SamplingParams
from lockstep import run_recording_logits


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
    """On the GPU the MoE experts and the routing are Triton kernels: torch.compile must leave their launches
    to run eagerly (``torch.compiler.disable``) and compile the rest of the block. In float32, so that the
    comparison checks the compiled code and not routing near-ties: in bf16 the compiled router GEMM may
    round a logit differently from the eager one, which can swap a token's k-th expert (one prompt's
    first-token logits moved by 25% in bf16). Logits within relative Frobenius error 1e-3, same greedy tokens."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [list(range(1, n)) for n in (5, 30, 12)]
    # a small KV pool: both engines are alive at once, and by default each would reserve most of the GPU
    kw = dict(model="tiny", device="cuda", dtype="float32", max_num_batched_tokens=64, num_kv_pages=64,
              max_model_len=256, backends={"moe": "triton", "routing": "fused", "attention": "torch"},
              enforce_eager=True)
    eager_seqs, eager_rows = run_recording_logits(LLM(**kw), prompts, params)
    llm = LLM(**kw, torch_compile=True)
    assert llm.engine.runner.ops.moe.name == "triton"
    assert all(b.routing_impl == "triton_topk" for b in llm.engine.runner.model.moe_blocks())
    seqs, rows = run_recording_logits(llm, prompts, params)
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in eager_seqs]
    assert rows.keys() == eager_rows.keys() and len(rows) >= len(prompts)
    for key, row in rows.items():
        err = float((row.float() - eager_rows[key].float()).norm() / eager_rows[key].float().norm())
        assert err < 1e-3, (key, err)
