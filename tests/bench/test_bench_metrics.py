"""The offline workloads' arithmetic and arrival rules, on synthetic timings (no engine)."""
import gc
import math

import pytest

from moeserve.bench.workloads import (WorkloadCase, make_requests, mixed_metrics, mixed_output_lengths, run_once,
                                      static_metrics, summarize)


def _req(first, nth, n, prompt_len=100, arrival=0.0, initial=True, last=None):
    return {"prompt_len": prompt_len, "max_tokens": n, "initial": initial, "arrival_s": arrival,
            "first_token_s": first, "nth_token_s": nth, "last_token_s": nth if last is None else last, "num_tokens": n}


def test_decode_metrics_follow_the_definitions():
    # two requests: first tokens at 0.10 and 0.12 s, 10th tokens at 1.00 and 1.02 s
    run = {"requests": [_req(0.10, 1.00, 10), _req(0.12, 1.02, 10)]}
    m = static_metrics(run, "decode")
    assert m["ttft_s"] == pytest.approx(0.12)
    assert m["decode_tok_s"] == pytest.approx(2 * 9 / (1.02 - 0.12))
    assert m["e2e_s"] == pytest.approx(1.02)
    assert m["total_tok_s"] == pytest.approx(2 * (100 + 10) / 1.02)
    assert m["output_tok_s"] == pytest.approx(2 * 10 / 1.02)
    assert m["request_throughput"] == pytest.approx(2 / 1.02)


def test_prefill_metrics_use_the_slowest_first_token():
    run = {"requests": [_req(0.2, 0.2, 1, prompt_len=512), _req(0.5, 0.5, 1, prompt_len=512)]}
    m = static_metrics(run, "prefill")
    assert m == {"ttft_s": pytest.approx(0.5), "prefill_tok_s": pytest.approx(2 * 512 / 0.5)}


def test_mixed_ttft_counts_only_requests_that_arrived_during_decode():
    run = {"requests": [_req(0.1, 1.0, 8, prompt_len=10), _req(0.1, 2.0, 8, prompt_len=10),
                        _req(1.3, 3.0, 8, prompt_len=10, arrival=1.0, initial=False),
                        _req(2.6, 4.0, 8, prompt_len=10, arrival=2.0, initial=False)]}
    m = mixed_metrics(run)
    assert m["ttft_s"] == pytest.approx((0.3 + 0.6) / 2)
    assert m["e2e_s"] == pytest.approx(4.0)
    assert m["total_tok_s"] == pytest.approx((40 + 32) / 4.0)
    assert m["output_tok_s"] == pytest.approx(32 / 4.0)


def test_summary_is_the_median_and_keeps_raw_runs():
    case = WorkloadCase("decode", 2, 16, 8)
    runs = [{"metrics": {"decode_tok_s": v, "ttft_s": 1.0}} for v in (10.0, 30.0, 20.0)]
    row = summarize(case, runs)
    assert row["decode_tok_s"] == 20.0 and row["runs"] is runs
    assert (row["workload"], row["concurrency"], row["prompt_len"], row["output_len"]) == ("decode", 2, 16, 8)


def test_requests_are_seeded_and_shaped_by_the_workload():
    case = WorkloadCase("mixed", 4, 12, 20, seed=7, arrival_every=4)
    a, b = make_requests(case, 0, 1000), make_requests(case, 0, 1000)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert make_requests(case, 1, 1000)[0].prompt != a[0].prompt
    assert len(a) == 12 and all(len(r.prompt) == 12 for r in a)
    assert all(10 <= t < 1000 for r in a for t in r.prompt)
    assert [r.max_tokens for r in a[:4]] == [20, 16, 12, 8] == mixed_output_lengths(4, 20, 4)[:4]
    assert all(r.max_tokens == 20 for r in a[4:])
    assert [r.max_tokens for r in make_requests(WorkloadCase("prefill", 3, 5, 8), 0, 50)] == [1, 1, 1]
    assert len({r.id for r in a} | {r.id for r in make_requests(case, -1, 1000)}) == 24


class FakeEngine:
    """One token per running request per step; at most ``slots`` requests run at once."""

    def __init__(self, clock, slots=100):
        self.clock, self.slots, self.running, self.added = clock, slots, {}, []

    def add(self, rid, prompt, max_tokens):
        self.added.append((rid, self.clock.now))
        self.running[rid] = [0, max_tokens]

    def step(self):
        self.clock.now += 1.0
        out = []
        for rid, st in list(self.running.items())[:self.slots]:
            st[0] += 1
            done = st[0] >= st[1]
            out.append((rid, st[0], done))
            if done:
                del self.running[rid]
        return out


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_static_run_times_every_token_at_step_return():
    clock = Clock()
    eng = FakeEngine(clock)
    case = WorkloadCase("decode", 3, 4, 5)
    run = run_once(eng, case, make_requests(case, 0, 100), clock=clock)
    assert run["steps"] == 5
    for r in run["requests"]:
        assert (r["first_token_s"], r["nth_token_s"], r["num_tokens"]) == (1.0, 5.0, 5)
    assert static_metrics(run, "decode")["decode_tok_s"] == pytest.approx(3 * 4 / 4.0)


def test_a_run_keeps_when_its_first_steps_returned():
    from moeserve.bench.workloads import FIRST_STEPS
    clock = Clock()
    case = WorkloadCase("decode", 2, 4, 7)
    run = run_once(FakeEngine(clock), case, make_requests(case, 0, 100), clock=clock)
    assert run["first_step_ends_s"] == [float(i) for i in range(1, FIRST_STEPS + 1)]
    case = WorkloadCase("prefill", 2, 4, 7)
    clock.now = 10.0
    assert run_once(FakeEngine(clock), case, make_requests(case, 0, 100), clock=clock)["first_step_ends_s"] == [1.0]


def test_a_run_counts_the_garbage_collections_inside_it():
    class Collecting(FakeEngine):
        def step(self):
            if self.clock.now == 1.0:
                gc.collect()  # a full (generation 2) collection inside the second step
            return super().step()
    clock = Clock()
    case = WorkloadCase("decode", 2, 4, 5)
    callbacks = len(gc.callbacks)
    run = run_once(Collecting(clock), case, make_requests(case, 0, 100), clock=clock)
    assert run["gc"]["collections"][2] >= 1
    assert 0 < run["gc"]["longest_s"] <= run["gc"]["seconds"]
    assert len(gc.callbacks) == callbacks
    gc.disable()  # no collection of its own can start during the next run, so it must report none
    try:
        quiet = run_once(FakeEngine(clock), case, make_requests(case, 1, 100), clock=clock)
    finally:
        gc.enable()
    assert quiet["gc"] == {"collections": [0, 0, 0], "seconds": 0.0, "longest_s": 0.0}


def test_mixed_run_adds_one_request_per_finish_and_keeps_c_in_flight():
    clock = Clock()
    eng = FakeEngine(clock)
    case = WorkloadCase("mixed", 3, 4, 6, arrival_every=2)
    reqs = make_requests(case, 0, 100)
    run = run_once(eng, case, reqs, clock=clock)
    assert len(eng.added) == 9 and [rid for rid, _ in eng.added] == [r.id for r in reqs]
    late = [r for r in run["requests"] if not r["initial"]]
    assert len(late) == 6
    # initial output lengths are 6, 4, 2: the 2-token request finishes at t=2, so the first late one arrives then
    assert [r.max_tokens for r in reqs[:3]] == [6, 4, 2]
    assert late[0]["arrival_s"] == 2.0 and late[0]["first_token_s"] == 3.0
    assert late[1]["arrival_s"] == 4.0
    m = mixed_metrics(run)
    assert m["ttft_s"] == pytest.approx(1.0) and math.isfinite(m["total_tok_s"])


class TokenEngine(FakeEngine):
    """A FakeEngine that also reports the tokens it generated: ``token(rid, i)`` is the i-th token of rid."""

    def __init__(self, clock, token):
        super().__init__(clock)
        self.token, self.tokens = token, {}

    def step(self):
        out = super().step()
        for rid, n, _ in out:
            self.tokens.setdefault(rid, []).append(self.token(rid, n - 1))
        return out

    def output_token_ids(self, rid):
        return self.tokens.pop(rid, None)


@pytest.mark.parametrize("token, expected", [
    (lambda rid, i: 7, 1 / 4),                       # every row decodes the same token
    (lambda rid, i: int(rid.rsplit("-", 1)[1]) + 1000 * i, 1.0),  # every row its own (ids end in -00000 ..)
    (lambda rid, i: int(rid[-1]) % 2, 2 / 4),          # two groups
])
def test_decode_reports_how_diverse_the_batch_is(token, expected):
    clock = Clock()
    case = WorkloadCase("decode", 4, 3, 6)
    run = run_once(TokenEngine(clock, token), case, make_requests(case, 0, 100), clock=clock)
    assert run["distinct_token_frac"] == pytest.approx(expected)
    assert static_metrics(run, "decode")["distinct_token_frac"] == pytest.approx(expected)


def test_diversity_needs_two_requests_and_ragged_outputs_count_who_is_there():
    from moeserve.bench.workloads import distinct_token_frac
    assert distinct_token_frac([[1, 2, 3]]) is None
    assert distinct_token_frac([[1, 2, 3], [1, 5]]) == pytest.approx((1 / 2 + 2 / 2) / 2)
    clock = Clock()
    case = WorkloadCase("prefill", 3, 4, 4)
    eng = TokenEngine(clock, lambda rid, i: 1)
    run = run_once(eng, case, make_requests(case, 0, 100), clock=clock)
    assert "distinct_token_frac" not in run and "distinct_token_frac" not in static_metrics(run, "prefill")
    assert eng.tokens == {}  # read back (and so forgotten) for every workload


def test_a_run_that_never_finishes_times_out():
    class Stuck:
        def add(self, *a):
            pass

        def step(self):
            return []
    case = WorkloadCase("decode", 1, 4, 4)
    callbacks = len(gc.callbacks)
    with pytest.raises(RuntimeError, match="not finished"):
        run_once(Stuck(), case, make_requests(case, 0, 100), timeout_s=0.05)
    assert len(gc.callbacks) == callbacks  # the collection timer is removed when a run fails too


def test_bad_cases_name_the_problem():
    with pytest.raises(ValueError, match="workload"):
        WorkloadCase("chat", 1, 4, 4)
    with pytest.raises(ValueError, match="output_len"):
        WorkloadCase("decode", 1, 4, 1)


def test_shared_prefix_requests_reuse_the_same_system_prompts_in_every_run():
    from moeserve.bench.workloads import WorkloadCase, make_requests
    case = WorkloadCase("shared-prefix", 4, 8, 3, prefix_len=32, prefix_groups=2, num_requests=10)
    runs = [make_requests(case, i, 1000) for i in (-1, 0)]
    prefixes = {tuple(r.prompt[:32]) for reqs in runs for r in reqs}
    assert len(prefixes) == 2  # the same two system prompts in the warm-up and the timed run
    assert all(len(r.prompt) == 40 and r.max_tokens == 3 for reqs in runs for r in reqs)
    assert [r.prompt[32:] for r in runs[0]] != [r.prompt[32:] for r in runs[1]]  # fresh suffixes per run
    assert len(runs[0]) == 10


def test_shared_prefix_on_the_engine_reports_the_hit_rate_and_keeps_c_in_flight():
    """The tiny model through the real engine with prefix caching: after a warm-up run the system prompts are
    cached, so every timed request finds its prefix's full pages (prefix 32 tokens = 8 pages of 4)."""
    from moeserve.bench.engine_driver import MoeserveAdapter
    from moeserve.bench.workloads import WorkloadCase, run_case
    from moeserve.engine.engine import LLMEngine
    from moeserve.config import make_config
    engine = LLMEngine(make_config(model="tiny", page_size=4, max_model_len=128, max_num_seqs=4,
                                   max_num_batched_tokens=64, enable_prefix_caching=True))
    case = WorkloadCase("shared-prefix", 3, 5, 3, prefix_len=32, prefix_groups=2, num_requests=7)
    row = run_case(MoeserveAdapter(engine), case, engine.arch.vocab_size, runs=1, warmup_runs=1)
    assert row["prefix_hit_rate"] == pytest.approx(7 * 32 / (7 * 37))
    assert row["ttft_s"] > 0 and row["total_tok_s"] > 0
    reqs = row["runs"][0]["requests"]
    assert len(reqs) == 7 and sum(1 for r in reqs if r["initial"]) == 3
    assert engine.pool.num_free == engine.pool.capacity


def test_a_run_keeps_how_its_first_steps_split_when_the_adapter_says():
    class Timed(FakeEngine):
        def last_step_seconds(self):
            return (0.25 * self.clock.now, 0.5)
    clock = Clock()
    case = WorkloadCase("decode", 2, 4, 3)
    run = run_once(Timed(clock), case, make_requests(case, 0, 100), clock=clock)
    assert run["first_step_parts_s"] == [[0.25, 0.5], [0.5, 0.5], [0.75, 0.5]]
    assert "first_step_parts_s" not in run_once(FakeEngine(clock), case, make_requests(case, 1, 100), clock=clock)
