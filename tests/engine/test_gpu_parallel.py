"""Tensor and expert parallelism over 2 GPUs with NCCL, against one GPU, in bfloat16.

Each multi-GPU engine (rank 0 in this process on cuda:0, rank 1 a worker on cuda:1) is stepped together with a
one-GPU engine on cuda:0 (same schedule, same tokens fed: the parallel engine's). Tolerance, bf16 through 3
layers with the sums of the split layers in another order: cosine similarity of each logits row > 0.995 and
the argmax agrees on at least 95% of rows (the same bounds as the fast path against the torch path).
Decode steps replay CUDA graphs that hold the collectives.
"""
import pytest
import torch

from hf_models import make_checkpoint
from lockstep import lockstep, random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

PROMPT_LENS = [5, 40, 130, 17, 66, 1, 250, 9]
MAX_TOKENS = 10
GPU_QWEN3 = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                 moe_intermediate_size=128, intermediate_size=256, num_experts=16, num_experts_per_tok=4,
                 vocab_size=512, initializer_range=0.05)
GPU_QWEN2 = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=128,
                 intermediate_size=256, shared_expert_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
                 vocab_size=500, initializer_range=0.05)
FAST = {k: "flashinfer" for k in ("attention", "norm", "rope", "activation", "sampling")}


def engine(path, moe: str, eager: bool, **options):
    from moeserve.config import make_config
    from moeserve.engine.engine import LLMEngine
    cfg = make_config(model=str(path), dtype="bfloat16", device="cuda", backends={**FAST, "moe": moe}, page_size=16,
                      max_num_batched_tokens=96, num_kv_pages=48, max_model_len=384, max_num_seqs=8,
                      enforce_eager=eager, cuda_graph_batch_sizes=[1, 2, 4, 8], **options)
    return LLMEngine(cfg)


@pytest.mark.parametrize("kind, shape, moe, ep, dispatch", [
    ("qwen3_moe", GPU_QWEN3, "triton", False, "auto"),
    ("qwen3_moe", GPU_QWEN3, "triton", True, "allreduce"),
    ("qwen3_moe", GPU_QWEN3, "triton", True, "allgather_reducescatter"),
    pytest.param("qwen3_moe", GPU_QWEN3, "flashinfer", False, "auto",  # cutlass_fused_moe with tp_size/tp_rank
                 id="qwen3_moe-flashinfer_cutlass-tp"),
    pytest.param("qwen3_moe", GPU_QWEN3, "flashinfer", True, "allreduce",  # cutlass_fused_moe with ep_size/ep_rank
                 id="qwen3_moe-flashinfer_cutlass-ep"),
    ("qwen2_moe", GPU_QWEN2, "triton", True, "allreduce"),  # shared expert (side stream) + padded vocabulary
])
def test_two_gpus_match_one(tmp_path, kind, shape, moe, ep, dispatch):
    make_checkpoint(kind, tmp_path, seed=1, **shape)
    one = engine(tmp_path, moe, eager=True)
    two = engine(tmp_path, moe, eager=False, tensor_parallel_size=2, enable_expert_parallel=ep,
                 expert_parallel_dispatch=dispatch)
    try:
        assert two.runner.graphs is not None, "decode steps should be captured with their collectives"
        r = lockstep(two, one, random_prompts(shape["vocab_size"], 4, PROMPT_LENS), MAX_TOKENS, follow="fast")
        assert r.graph_steps > 0
        assert r.worst > 0.995, f"worst cosine {r.worst:.5f}"
        assert r.agreement >= 0.95, f"argmax agreement {r.agreement:.3f}"
    finally:
        two.shutdown()


def test_graph_decode_with_collectives_matches_eager(tmp_path):
    """CUDA graphs that hold all-reduces and all-gathers replay the eager steps exactly (same kernels, same
    collectives, same order), and the engine's tokens match through asynchronous scheduling."""
    from moeserve.engine.sampling_params import SamplingParams
    make_checkpoint("qwen3_moe", tmp_path, seed=2, **GPU_QWEN3)
    outs = {}
    for eager in (True, False):
        eng = engine(tmp_path, "triton", eager=eager, tensor_parallel_size=2, enable_expert_parallel=True)
        try:
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            seqs = [eng.add_request(p, params) for p in random_prompts(512, 9, PROMPT_LENS)]
            while eng.has_unfinished():
                eng.step()
            outs[eager] = [list(s.output_token_ids) for s in seqs]
            assert (eng.runner.graphs is None) == eager
        finally:
            eng.shutdown()
    assert outs[False] == outs[True]


def test_a_dead_gpu_rank_stops_the_engine(tmp_path):
    """A rank killed while NCCL collectives are in flight: the engine names it within seconds (the process
    group is aborted so rank 0 does not wait on the dead rank)."""
    import os
    import signal
    import time
    from moeserve.engine.sampling_params import SamplingParams
    from moeserve.engine.workers import WorkerError
    make_checkpoint("qwen3_moe", tmp_path, seed=3, **GPU_QWEN3)
    eng = engine(tmp_path, "triton", eager=False, tensor_parallel_size=2)
    try:
        for p in random_prompts(512, 5, PROMPT_LENS):
            eng.add_request(p, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
        for _ in range(5):
            eng.step()
        pid = eng.runner.worker_pids[0]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"rank 1 \(pid {pid}\)"):
            while eng.has_unfinished():
                eng.step()
        assert time.monotonic() - t0 < 30
    finally:
        eng.shutdown()
