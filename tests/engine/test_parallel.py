"""Tensor and expert parallelism on the CPU: 2 ranks (rank 0 in this process, rank 1 a worker process, gloo)
give exactly the greedy tokens of one process in float32, for Qwen2-MoE, Qwen3-MoE and GLM-4-MoE, with
chunked prefill, preemption and asynchronous scheduling (in-flight tokens fed from each rank's own sampled
tokens); a rank that dies stops the engine with an error naming it, within seconds."""
import os
import signal
import time

import pytest
import torch

from hf_models import make_checkpoint
from lockstep import lockstep
from moeserve import LLM, SamplingParams
from moeserve.engine.workers import WorkerError

PROMPT_LENS = [3, 17, 40, 9]
MAX_TOKENS = 10
# 2 layers (one dense where the family has one); Qwen2-MoE with a vocabulary that 2 ranks split unevenly
# (250 rows padded to 256: rank 1 holds 122 real rows), GLM with q/k/v biases, q/k norms and a correction bias
MODELS = {"qwen2_moe": dict(num_hidden_layers=2, vocab_size=250), "qwen3_moe": dict(num_hidden_layers=2),
          "glm4_moe": dict(num_hidden_layers=2)}
# A token budget of 16 splits prompts into chunks; 24 usable pages of 4 tokens hold fewer tokens than the four
# requests need together, which forces preemption.
ENGINE = dict(dtype="float32", device="cpu", max_num_batched_tokens=16, page_size=4, num_kv_pages=25,
              max_model_len=96, max_num_seqs=4)


def requests(vocab: int):
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in PROMPT_LENS]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    return prompts, [greedy, greedy, seeded, greedy]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """Per model: its checkpoint and the tokens of one process."""
    out = {}
    for kind, shape in MODELS.items():
        path = tmp_path_factory.mktemp(kind)
        make_checkpoint(kind, path, **shape)
        prompts, params = requests(shape.get("vocab_size", 256))
        llm = LLM(model=str(path), **ENGINE)
        out[kind] = (path, [o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    return out


@pytest.mark.parametrize("kind,expert_parallel,dispatch", [
    ("qwen2_moe", False, "auto"), ("qwen2_moe", True, "allreduce"),
    ("qwen3_moe", False, "auto"), ("qwen3_moe", True, "allgather_reducescatter"),
    ("glm4_moe", False, "auto"), ("glm4_moe", True, "allgather_reducescatter"),
])
def test_two_ranks_give_the_tokens_of_one(single_process, kind, expert_parallel, dispatch):
    path, expected = single_process[kind]
    llm = LLM(model=str(path), tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              expert_parallel_dispatch=dispatch, **ENGINE)
    try:
        runner = llm.engine.runner
        assert runner.parallel.tp_size == 2 and runner.parallel.ep_size == (2 if expert_parallel else 1)
        assert runner.kv.num_kv_heads == 1  # 2 kv heads split over 2 ranks
        block = runner.model.moe_blocks()[0]
        assert block.w13.shape[0] == (4 if expert_parallel else 8)  # whole experts, or all of them sliced
        assert block.w13.shape[1] == (64 if expert_parallel else 32)
        prompts, params = requests(MODELS[kind].get("vocab_size", 256))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == expected
        stats = llm.engine.stats
        assert stats["prefill_chunks"] > 0, "the token budget should have split prompts into chunks"
        assert llm.engine.scheduler.num_preemptions > 0, "the small page pool should have forced preemption"
        assert llm.engine.pool.num_free == llm.engine.pool.capacity
    finally:
        llm.shutdown()


def test_two_ranks_give_the_logits_of_one(single_process):
    """Stepped together with a one-process engine on the same schedule and tokens, every sampled row's logits
    agree (float32: only the order of the sums differs)."""
    from moeserve.config import make_config
    from moeserve.engine.engine import LLMEngine
    path, _ = single_process["glm4_moe"]
    one = LLMEngine(make_config(model=str(path), **ENGINE))
    two = LLMEngine(make_config(model=str(path), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE))
    try:
        prompts, _ = requests(256)
        r = lockstep(two, one, [p["prompt_token_ids"] for p in prompts], MAX_TOKENS)
        assert r.worst > 0.99999 and r.agreement == 1.0
    finally:
        two.shutdown()


def test_a_dead_rank_stops_the_engine_with_its_name(single_process):
    path, _ = single_process["qwen3_moe"]
    llm = LLM(model=str(path), tensor_parallel_size=2, **{**ENGINE, "num_kv_pages": 200})
    engine = llm.engine
    try:
        for n in (30, 20):
            engine.add_request(list(range(1, n)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        for _ in range(4):
            engine.step()
        pid = engine.runner.worker_pids[0]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"rank 1 \(pid {pid}\) exited with code -9"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - t0 < 10
        with pytest.raises(WorkerError, match="the engine stopped"):  # and stays stopped
            engine.step()
    finally:
        llm.shutdown()


def test_shutdown_stops_the_other_ranks(single_process):
    path, _ = single_process["qwen2_moe"]
    llm = LLM(model=str(path), tensor_parallel_size=2, **ENGINE)
    procs = list(llm.engine.runner._procs)
    llm.shutdown()
    assert all(not p.is_alive() and p.exitcode == 0 for p in procs)
    assert not torch.distributed.is_initialized()


def test_fp8_checkpoint_splits_on_block_boundaries(tmp_path):
    """A block-FP8 checkpoint whose per-rank parts are whole 128x128 blocks: each rank reads its weights and
    their scales, and 2 ranks give the tokens of one."""
    from moeserve.tools.fp8_export import write_fp8_checkpoint
    make_checkpoint("qwen3_moe", tmp_path / "hp", num_hidden_layers=2, hidden_size=128, num_attention_heads=8,
                    num_key_value_heads=8, head_dim=32, moe_intermediate_size=256, intermediate_size=256)
    write_fp8_checkpoint(tmp_path / "hp", tmp_path / "fp8")
    prompts, params = requests(256)
    prompts, params = prompts[:3], params[:3]
    kw = dict(ENGINE, num_kv_pages=100, max_num_batched_tokens=64)
    one = LLM(model=str(tmp_path / "fp8"), **kw)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    llm = LLM(model=str(tmp_path / "fp8"), tensor_parallel_size=2, **kw)
    try:
        block = llm.engine.runner.model.moe_blocks()[0]
        assert block.w13.dtype == torch.float8_e4m3fn and tuple(block.w13_scale_inv.shape) == (8, 2, 1)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.shutdown()
