"""The scheduler -> runner contract is plain data: a step survives pickling, holds no live engine object, and
the runner computes the same tokens from the unpickled copy; seeded random state stays with the sampler."""
import dataclasses
import pickle

from moeserve.config import make_config
from moeserve.engine.engine import LLMEngine
from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.step import SamplingRow, ScheduledRequest, StepInput, StepOutput

PLAIN = (int, float, str, bool, type(None))


def assert_plain(x, path="step"):
    """Only ints, floats, strings, bools, None, lists/tuples/dicts of them and the contract's dataclasses."""
    if isinstance(x, PLAIN):
        return
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            assert_plain(v, f"{path}[{i}]")
    elif isinstance(x, dict):
        for k, v in x.items():
            assert_plain(k, f"{path} key")
            assert_plain(v, f"{path}[{k!r}]")
    elif dataclasses.is_dataclass(x):
        assert type(x) in (StepInput, ScheduledRequest, SamplingRow, StepOutput), f"{path}: {type(x).__name__}"
        for f in dataclasses.fields(x):
            assert_plain(getattr(x, f.name), f"{path}.{f.name}")
    else:
        raise AssertionError(f"{path} is a {type(x).__name__}, not plain data")


def engine(**kw):
    return LLMEngine(make_config(model="tiny", max_num_batched_tokens=32, page_size=4, max_model_len=96,
                                 max_num_seqs=4, async_scheduling=False, **kw))


def test_steps_are_plain_data_and_run_the_same_after_pickling():
    a, b = engine(), engine()
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=8, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, max_tokens=6, ignore_eos=True)]
    prompts = [[5, 6, 7], list(range(10, 50)), [9] * 7]  # the long one is chunked: a mixed step
    for e in (a, b):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            e.add_request(p, sp, request_id=f"r{i}")
    steps = 0
    while a.has_unfinished():
        out_a, out_b = a.scheduler.schedule(), b.scheduler.schedule()
        step = out_a.step_input(steps)
        assert_plain(step)
        copy = pickle.loads(pickle.dumps(step))
        assert copy == step
        got_a = a.runner.execute(step)
        got_b = b.runner.execute(copy)
        assert_plain(got_a)
        assert got_a == got_b  # same tokens from the original and the unpickled step, seeded rows included
        a.scheduler.update(out_a, got_a.sampled)
        b.scheduler.update(out_b, got_b.sampled)
        steps += 1
    assert steps > 3


def test_the_sampler_forgets_a_finished_requests_stream():
    e = engine(backends={"sampling": "torch"})
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=3, ignore_eos=True)
    e.add_request([1, 2, 3], seeded, request_id="s")
    e.add_request([4, 5], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), request_id="g")
    seen = []
    while e.has_unfinished():
        e.step()
        seen.append(set(e.runner.sampler._seeded))
    assert {"s"} in seen and seen[-1] == set()  # made on first use, dropped once "s" finished


def test_is_decode_is_one_definition():
    r = ScheduledRequest("x", 5, [1], [1, 2], True)
    assert r.is_decode and StepInput(0, [r]).is_decode
    first = ScheduledRequest("y", 0, [1], [3], True)  # a one-token prompt is a prefill, not a decode
    assert not first.is_decode and not StepInput(0, [r, first]).is_decode
    assert not StepInput(0, []).is_decode
