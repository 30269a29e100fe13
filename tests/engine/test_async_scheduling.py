"""Asynchronous scheduling: the engine launches step k+1 before the tokens of step k reach the host. The
tokens, finish reasons and page accounting must be exactly those of synchronous steps, and the overlap
must really happen (steps built while their input tokens are still in flight)."""
import pytest
import torch

from moeserve.config import make_config
from moeserve.engine.batch import BatchBuilder
from moeserve.engine.engine import LLMEngine
from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.scheduler import ScheduledSeq
from moeserve.engine.sequence import Sequence

MAX_MODEL_LEN = 96


def make_engine(async_scheduling: bool, **kw) -> LLMEngine:
    opts = dict(model="tiny", max_num_batched_tokens=48, page_size=8, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                seed=3)
    return LLMEngine(make_config(async_scheduling=async_scheduling, **{**opts, **kw}))


def watch_builds(engine) -> list[int]:
    """Per built step: how many of its requests feed a token that is still in flight."""
    counts = []
    build = engine.runner.builder.build

    def counting(items, **kw):
        counts.append(sum(it.inflight_row >= 0 for it in items))
        return build(items, **kw)

    engine.runner.builder.build = counting
    return counts


def run(engine, requests, abort=None) -> dict:
    """Every request to the end; ``abort=(step, request_id)`` aborts one after that many steps."""
    seqs = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(requests)]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if abort is not None and steps == abort[0]:
            assert engine.abort_request(abort[1])
        assert steps < 3000, "the engine did not finish"
    assert engine.pool.num_free == engine.pool.capacity, "pages leaked"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return {s.request_id: (list(s.output_token_ids), s.finish_reason) for s in seqs}


def requests(stop_token: int | None = None):
    g = torch.Generator().manual_seed(11)
    prompt = lambda n: torch.randint(3, 200, (n,), generator=g).tolist()  # noqa: E731
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [
        (prompt(5), greedy),
        (prompt(70), greedy),  # a chunked prompt: mixed steps
        (prompt(9), SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True)),
        (prompt(88), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)),  # ends at max_model_len
        (prompt(14), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                    stop_token_ids=[stop_token] if stop_token is not None else [])),
        (prompt(1), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
        (prompt(33), SamplingParams(temperature=0.8, max_tokens=9, ignore_eos=True)),  # unseeded: not compared
    ]


@pytest.mark.parametrize("pool", [None, 14], ids=["roomy-cache", "preempting-cache"])
def test_async_steps_give_the_tokens_of_sync_steps(pool):
    sync = make_engine(False, num_kv_pages=pool)
    base = run(sync, requests())
    stop_token = base["r4"][0][3]  # a token r4 produces: it must stop there (or earlier) in both modes
    sync = make_engine(False, num_kv_pages=pool)
    want = run(sync, requests(stop_token))
    eng = make_engine(True, num_kv_pages=pool)
    in_flight = watch_builds(eng)
    got = run(eng, requests(stop_token))
    for rid in want:
        if rid != "r6":
            assert got[rid] == want[rid], rid
    assert got["r6"][1] == "length" and len(got["r6"][0]) == 9
    assert want["r4"][1] == "stop" and len(want["r4"][0]) <= 4
    assert want["r3"][1] == "length" and len(want["r3"][0]) == MAX_MODEL_LEN - 88
    assert want["r5"] == (want["r5"][0], "length") and len(want["r5"][0]) == 1
    if pool is not None:
        assert sync.scheduler.num_preemptions > 0 and eng.scheduler.num_preemptions > 0
    assert sum(in_flight) > 0, "no step was built while its input tokens were in flight"


def test_sync_steps_never_wait_on_in_flight_tokens():
    eng = make_engine(False)
    in_flight = watch_builds(eng)
    run(eng, requests())
    assert in_flight and sum(in_flight) == 0


def test_async_step_hands_out_the_previous_steps_tokens():
    eng = make_engine(True)
    seq = eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert eng.step() == []  # the prefill is launched; nothing has arrived yet
    assert seq.num_inflight == 1 and seq.output_token_ids == [] and eng.has_unfinished()
    assert eng.step() == [seq]  # the first decode is launched; the prefill's token arrives
    assert len(seq.output_token_ids) == 1 and seq.num_inflight == 1
    eng.step()
    assert len(seq.output_token_ids) == 2
    assert eng.step() == [seq] and seq.is_finished and seq.output_token_ids == run(
        make_engine(False), [([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))])["r0"][0]
    assert not eng.has_unfinished()


def test_abort_while_a_token_is_in_flight():
    want = run(make_engine(False), requests())
    eng = make_engine(True)
    got = run(eng, requests(), abort=(6, "r0"))
    assert got["r0"][1] == "abort" and got["r0"][0] == want["r0"][0][:len(got["r0"][0])]
    for rid in ("r1", "r2", "r3", "r5"):
        assert got[rid] == want[rid], rid


def test_builder_feeds_in_flight_tokens_from_the_previous_steps_device_tokens():
    builder = BatchBuilder(page_size=4, max_tokens=32, max_seqs=4, max_pages=16, device=torch.device("cpu"))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a, b = Sequence("a", [1, 2, 3], params), Sequence("b", [4, 5, 6, 7, 8], params)
    a.pages, b.pages = [1], [2, 3]
    a.output_token_ids, a.num_computed = [9], 3  # token 9 known: fed from the host
    b.num_inflight, b.last_row, b.num_computed = 1, 2, 5  # its sampled token is row 2 of the last step
    prev = torch.tensor([50, 60, 70, 80])
    decode = builder.build([ScheduledSeq(a, 3, 1).request(), ScheduledSeq(b, 5, 1).request()], prev_tokens=prev)
    assert decode.input_ids.tolist() == [9, 70] and decode.positions.tolist() == [3, 5]
    c = Sequence("c", list(range(10, 16)), params)
    c.pages = [4, 5]
    mixed = builder.build([ScheduledSeq(b, 5, 1).request(), ScheduledSeq(c, 0, 6).request()], prev_tokens=prev)
    assert mixed.input_ids.tolist() == [70, 10, 11, 12, 13, 14, 15]
    with pytest.raises(RuntimeError, match="previous step"):
        builder.build([ScheduledSeq(b, 5, 1).request()])


def test_a_step_reports_how_long_it_launched_and_waited():
    import time
    engine = make_engine(True)
    engine.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    walls, parts = [], []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
        parts.append(engine.last_step_seconds)
    assert len(parts) == 4  # the prefill, two decode steps, and the step that only receives the last token
    for (launch, wait), wall in zip(parts, walls):
        assert launch >= 0 and wait >= 0 and launch + wait <= wall
    assert parts[0][0] > 100 * parts[0][1]  # the first step only launches: nothing of its own is in flight yet
