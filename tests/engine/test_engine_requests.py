"""Engine behaviour seen from requests: batching invariance, seeds, stop conditions, and bad requests."""
import json

import pytest

from moeserve import LLM, SamplingParams
from moeserve.config import ConfigError
from moeserve.engine.requests import RequestError


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny", max_num_batched_tokens=48, page_size=8, max_model_len=256, max_num_seqs=16)


PROMPTS = [[5 + i for i in range(n)] for n in (3, 40, 11, 77, 1)]


def ids(p):
    return {"prompt_token_ids": p}


def test_batching_does_not_change_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate([ids(p) for p in PROMPTS], params)]
    alone = [llm.generate(ids(p), params)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone
    assert llm.engine.pool.num_free == llm.engine.pool.capacity


def test_all_greedy_steps_skip_the_sampling_tensors_and_mixed_steps_build_them(llm, monkeypatch):
    runner = llm.engine.runner
    built = []
    original = runner.sampling_batch
    monkeypatch.setattr(runner, "sampling_batch", lambda items: built.append(len(items)) or original(items))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate([ids(p) for p in PROMPTS[:3]], greedy)]
    assert built == []
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    out = llm.generate([ids(p) for p in PROMPTS[:3]], [greedy, sampled, greedy])
    assert built and [out[0].outputs[0].token_ids, out[2].outputs[0].token_ids] == [first[0], first[2]]


def test_seed_gives_same_tokens_regardless_of_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(ids(PROMPTS[1]), seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate([ids(PROMPTS[0]), ids(PROMPTS[1]), ids(PROMPTS[2])], [others, seeded, others])
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = llm.generate(ids(PROMPTS[1]), SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12,
                                                              ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_returns_distinct_samples(llm):
    out = llm.generate(ids(PROMPTS[2]), SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1


def test_max_tokens_and_stop_token_ids(llm):
    greedy = llm.generate(ids(PROMPTS[3]), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    toks = greedy.outputs[0].token_ids
    assert len(toks) == 10 and greedy.outputs[0].finish_reason == "length"
    stop = toks[4]
    first = toks.index(stop)
    out = llm.generate(ids(PROMPTS[3]), SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop]))[0]
    assert out.outputs[0].token_ids == toks[:first + 1] and out.outputs[0].finish_reason == "stop"


def test_eos_and_ignore_eos(tmp_path):
    cfg = json.loads(open(__import__("moeserve.config", fromlist=["PRESET_DIR"]).PRESET_DIR / "tiny.json").read())
    probe = LLM(model="tiny").generate(ids(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    toks = probe[0].outputs[0].token_ids
    cfg["eos_token_id"] = toks[2]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(tmp_path), load_format="dummy")  # the directory holds only config.json
    stopped = llm.generate(ids(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == toks[:toks.index(toks[2]) + 1]
    full = llm.generate(ids(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert full.token_ids == toks and full.finish_reason == "length"


def test_generation_stops_at_max_model_len():
    llm = LLM(model="tiny", max_model_len=20, page_size=4)
    out = llm.generate(ids(list(range(1, 16))), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("make, needle", [
    (lambda: SamplingParams(max_tokens=-1), "max_tokens: must be a positive integer"),
    (lambda: SamplingParams(temperature=-0.5), "temperature: must be in [0, 100]"),
    (lambda: SamplingParams(top_p=0.0), "top_p: must be in (0, 1]"),
    (lambda: SamplingParams(top_k=-3), "top_k: must be -1, 0"),
    (lambda: SamplingParams(min_p=1.5), "min_p: must be in [0, 1]"),
    (lambda: SamplingParams(n=0), "n: must be an integer >= 1"),
])
def test_bad_sampling_params_name_the_parameter(make, needle):
    with pytest.raises(ValueError) as e:
        make()
    assert needle in str(e.value)


def test_bad_requests_leave_other_requests_running(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate([ids(p) for p in PROMPTS[:2]], params)]
    good = [engine.add_request(p, params) for p in PROMPTS[:2]]
    engine.step()  # the good ones are in flight
    with pytest.raises(RequestError, match=r"prompt: the prompt has 300 tokens but this model's maximum context length \(max_model_len\) is 256"):
        engine.add_request(list(range(300)), params)
    with pytest.raises(RequestError, match=r"prompt: every token id must be an integer in \[0, 1024\)"):
        engine.add_request([1, 5000], params)
    with pytest.raises(RequestError, match="prompt: must hold at least one token"):
        engine.add_request([], params)
    bad = SamplingParams(max_tokens=4)
    bad.max_tokens = -2
    with pytest.raises(RequestError, match="max_tokens"):
        engine.add_request([1, 2], bad)
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate("hello", params)
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in good] == expected
    assert engine.pool.num_free == engine.pool.capacity


def test_generate_validates_every_prompt_first(llm):
    before = llm.engine.pool.num_free
    with pytest.raises(RequestError, match=r"prompts\[1\]: prompt: the prompt has 300 tokens"):
        llm.generate([ids([1, 2]), ids(list(range(300)))], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished() and llm.engine.pool.num_free == before


def test_unknown_preset_is_a_config_error():
    with pytest.raises(ConfigError, match="model: 'qwen9' is neither a preset"):
        LLM(model="qwen9")


def test_reports_name_the_fused_kernels(llm):
    """``describe()["fusions"]`` names the kernels that do more than their operator's backend says: none on the
    CPU's torch backends; the QKV kernel, the activation inside the expert GEMM and the router's split-K GEMM
    where they run."""
    from types import SimpleNamespace as NS

    from moeserve.engine.runner import ModelRunner
    assert llm.engine.describe()["fusions"] == [] and llm.engine.describe()["pdl_max_tokens"] == 0
    block = NS(w13_order="interleaved", router_gemm_split=lambda tokens: tokens <= 64)
    fused = NS(ops=NS(attention=NS(fuse_qkv=True)), model=NS(moe_blocks=lambda: [block]))
    assert ModelRunner.fusions.fget(fused) == ["qkv-norm-rope-append", "swiglu-in-expert-gemm", "router-gemm-split-k"]
    block = NS(w13_order="gate_up", router_gemm_split=lambda tokens: False)
    plain = NS(ops=NS(attention=NS(fuse_qkv=False)), model=NS(moe_blocks=lambda: [block]))
    assert ModelRunner.fusions.fget(plain) == []
