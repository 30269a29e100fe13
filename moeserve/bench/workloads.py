"""The offline workloads: which requests each engine gets, when they arrive, and what is measured.

Every engine is driven by the same loop, :func:`run_once`, through an adapter with two methods:

- ``add(request_id, prompt_token_ids, max_tokens)``: queue a greedy, ignore-EOS request;
- ``step() -> [(request_id, tokens_so_far, finished), ...]``: run one engine step and report the
  requests that got tokens.

The clock is read when ``step`` returns, for every engine alike, so a token's time is when the
caller could first see it. Nothing here imports an engine; the vLLM worker runs this module too.

Workloads at concurrency ``c`` (each cell is ``bench.runs`` timed runs after ``bench.warmup_runs``):

- ``prefill``: ``c`` prompts, ``max_tokens=1``. ``ttft_s`` = time until every request has its first
  token; ``prefill_tok_s = c * prompt_len / ttft_s``.
- ``decode``: ``c`` prompts, ``max_tokens=output_len``. With ``t_1`` the time every request has its
  first token and ``t_N`` the time every request has its N-th: ``decode_tok_s = c*(N-1)/(t_N - t_1)``;
  also ``ttft_s``, ``e2e_s``, ``total_tok_s = c*(prompt_len+N)/e2e_s``, ``output_tok_s``,
  ``request_throughput``.
- ``mixed``: ``3c`` requests, ``c`` in flight: the first ``c`` have staggered output lengths so they
  finish at different times, and each time a request finishes the next one is added, so prompts
  arrive while others decode. ``total_tok_s``, ``output_tok_s``, ``request_throughput``, ``e2e_s``,
  and ``ttft_s`` = mean TTFT of the requests that arrived while others were decoding.
- ``shared-prefix``: ``requests`` requests, ``c`` in flight, each one of ``groups`` system prompts of
  ``prefix_len`` tokens (the same in every run) followed by ``prompt_len`` unique tokens. ``ttft_s`` = mean
  TTFT, ``total_tok_s``, ``output_tok_s``, ``request_throughput``, and ``prefix_hit_rate`` = prompt tokens
  found in the engine's prefix cache / prompt tokens (when the adapter reports ``num_cached_tokens``).

Each run also records, to tell where a slow first token comes from, when its first
``FIRST_STEPS`` steps returned (``first_step_ends_s``), for an adapter that reports it how each of them split
between launching and waiting (``first_step_parts_s``: ``[launch, wait]`` seconds each), and the Python garbage
collections that ran during it (``gc``: collections per generation, seconds in them, the longest), timed by
``gc.callbacks``.

``distinct_token_frac`` (decode, when the adapter can return the tokens it generated): the mean over
output positions of the number of distinct token ids across the batch divided by the batch size. Random
(dummy) weights can make greedy decoding collapse onto a few tokens; a batch that decodes the same token
everywhere routes every row to the same experts and reads far fewer expert weights than a real model, so a
decode figure is only comparable between engines whose batches are about as diverse.
"""
from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Protocol

WORKLOADS = ("prefill", "decode", "mixed", "shared-prefix")
MIXED_REQUESTS_PER_SLOT = 3
TOKEN_ID_LOW = 10  # keep clear of the special ids small vocabularies put first
TOKEN_ID_HIGH = 32000
RUN_TIMEOUT_S = 900.0
FIRST_STEPS = 4  # step return times kept per run


class EngineAdapter(Protocol):
    def add(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None: ...

    def step(self) -> list[tuple[str, int, bool]]: ...

    # Optional: ``output_token_ids(request_id) -> list[int] | None``, the tokens a request generated.


@dataclass(frozen=True)
class WorkloadCase:
    """One cell of the benchmark: a workload at one concurrency with fixed lengths."""

    workload: str
    concurrency: int
    prompt_len: int
    output_len: int
    seed: int = 0
    arrival_every: int = 4  # mixed: initial output lengths differ by this many tokens
    prefix_len: int = 0  # shared-prefix: tokens of each system prompt
    prefix_groups: int = 0  # shared-prefix: how many system prompts
    num_requests: int = 0  # shared-prefix: requests per run

    def __post_init__(self):
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: {self.workload!r} is not one of {', '.join(WORKLOADS)}")
        if self.concurrency < 1 or self.prompt_len < 1 or self.output_len < 2:
            raise ValueError(f"workload {self.workload}: concurrency and prompt_len must be >= 1 and "
                             f"output_len >= 2 (got {self.concurrency}, {self.prompt_len}, {self.output_len})")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Request:
    id: str
    prompt: list[int]
    max_tokens: int


def build_cases(bench) -> list[WorkloadCase]:
    """The cells of a ``BenchConfig`` in report order: workload by workload, concurrency ascending."""
    cases = []
    for w in bench.workloads:
        levels = bench.concurrency
        if w == "shared-prefix" and bench.shared_prefix.concurrency:
            levels = bench.shared_prefix.concurrency
        for c in sorted(set(levels)):
            if w == "shared-prefix":
                sp = bench.shared_prefix
                cases.append(WorkloadCase(w, c, sp.suffix_len, sp.output_len, bench.seed, bench.mixed_arrival_every,
                                          sp.prefix_len, sp.groups, sp.requests))
            else:
                cases.append(WorkloadCase(w, c, bench.prompt_len, bench.output_len, bench.seed,
                                          bench.mixed_arrival_every))
    return cases


def mixed_output_lengths(c: int, output_len: int, every: int) -> list[int]:
    """Output lengths of the ``3c`` mixed requests: the first ``c`` staggered by ``every`` tokens."""
    initial = [max(2, output_len - (i * every) % output_len) for i in range(c)]
    return initial + [output_len] * ((MIXED_REQUESTS_PER_SLOT - 1) * c)


def make_requests(case: WorkloadCase, run_index: int, vocab_size: int) -> list[Request]:
    """The requests of one run, the same for every engine (seeded by the case and the run index)."""
    rng = random.Random(f"{case.seed}:{case.workload}:{case.concurrency}:{case.prompt_len}:{run_index}")
    high = max(TOKEN_ID_LOW + 1, min(vocab_size, TOKEN_ID_HIGH))
    low = TOKEN_ID_LOW if vocab_size > TOKEN_ID_LOW + 1 else 0
    tag = f"{case.workload[0]}{case.concurrency}r{run_index}"
    if case.workload == "shared-prefix":
        fixed = random.Random(f"{case.seed}:shared-prefix:{case.prefix_len}")  # the same system prompts every run
        prefixes = [[fixed.randrange(low, high) for _ in range(case.prefix_len)] for _ in range(case.prefix_groups)]
        return [Request(f"{tag}-{i:05d}", prefixes[rng.randrange(case.prefix_groups)]
                        + [rng.randrange(low, high) for _ in range(case.prompt_len)], case.output_len)
                for i in range(case.num_requests)]
    if case.workload == "prefill":
        lengths = [1] * case.concurrency
    elif case.workload == "decode":
        lengths = [case.output_len] * case.concurrency
    else:
        lengths = mixed_output_lengths(case.concurrency, case.output_len, case.arrival_every)
    return [Request(f"{tag}-{i:05d}", [rng.randrange(low, high) for _ in range(case.prompt_len)], n)
            for i, n in enumerate(lengths)]


class GcPauses:
    """Python garbage collections while the block runs: count per generation, total and longest seconds."""

    def __init__(self):
        self.collections, self.seconds, self.longest, self._start = [0, 0, 0], 0.0, 0.0, None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            took = time.perf_counter() - self._start
            self._start = None
            self.collections[min(int(info.get("generation", 0)), 2)] += 1
            self.seconds += took
            self.longest = max(self.longest, took)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        return {"collections": list(self.collections), "seconds": self.seconds, "longest_s": self.longest}


def run_once(adapter: EngineAdapter, case: WorkloadCase, requests: list[Request],
             clock: Callable[[], float] = time.perf_counter, timeout_s: float = RUN_TIMEOUT_S) -> dict:
    """Drive one run; returns per-request times (seconds from the first ``add``), the step count, when the
    first steps returned and the garbage collections during the run."""
    with GcPauses() as pauses:
        run = _drive(adapter, case, requests, clock, timeout_s)
    run["gc"] = pauses.summary()
    return run


def _drive(adapter: EngineAdapter, case: WorkloadCase, requests: list[Request], clock: Callable[[], float],
           timeout_s: float) -> dict:
    c = case.concurrency
    pending = list(reversed(requests))
    info = {r.id: {"prompt_len": len(r.prompt), "max_tokens": r.max_tokens, "initial": True} for r in requests}
    times: dict[str, list[float]] = {r.id: [] for r in requests}
    arrival: dict[str, float] = {}
    finished: dict[str, float] = {}

    def add(initial: bool) -> None:
        r = pending.pop()
        info[r.id]["initial"] = initial
        arrival[r.id] = clock()
        adapter.add(r.id, r.prompt, r.max_tokens)

    t0 = clock()
    for _ in range(min(c, len(pending))):
        add(True)
    steps = 0
    step_ends: list[float] = []
    parts = getattr(adapter, "last_step_seconds", None)
    step_parts: list[list[float]] = []
    while len(finished) < len(requests):
        outs = adapter.step()
        now = clock()
        steps += 1
        if steps <= FIRST_STEPS:
            step_ends.append(now - t0)
            if parts is not None:
                step_parts.append(list(parts()))
        for rid, n, done in outs:
            tt = times[rid]
            if n > len(tt):
                tt.extend([now] * (n - len(tt)))
            if done and rid not in finished:
                finished[rid] = now
                if pending:
                    add(False)
        if now - t0 > timeout_s:
            raise RuntimeError(f"{case.workload} c={c}: not finished after {timeout_s:.0f} s "
                               f"({len(finished)}/{len(requests)} requests done, {steps} steps)")
    reqs = []
    outputs = getattr(adapter, "output_token_ids", None)
    for r in requests:
        tt = times[r.id]
        reqs.append({**info[r.id], "arrival_s": arrival[r.id] - t0, "first_token_s": tt[0] - t0,
                     "nth_token_s": tt[min(len(tt), r.max_tokens) - 1] - t0, "last_token_s": tt[-1] - t0,
                     "num_tokens": len(tt)})
    run = {"steps": steps, "requests": reqs, "first_step_ends_s": step_ends}
    if parts is not None:
        run["first_step_parts_s"] = step_parts
    cached = getattr(adapter, "num_cached_tokens", None)
    if cached is not None and case.workload == "shared-prefix":
        for r, rec in zip(requests, reqs):
            rec["cached_tokens"] = cached(r.id)
    if outputs is not None:
        tokens = [outputs(r.id) or [] for r in requests]  # read for every workload: the adapter forgets them
        frac = distinct_token_frac(tokens) if case.workload == "decode" else None
        if frac is not None:
            run["distinct_token_frac"] = frac
    return run


def distinct_token_frac(outputs: list[list[int]]) -> float | None:
    """Mean over output positions of (distinct token ids at that position) / (requests that reached it);
    None for fewer than two requests. 1.0: every row decodes its own token; 1/c: all rows the same."""
    if len(outputs) < 2:
        return None
    fracs = []
    for pos in range(max(len(o) for o in outputs)):
        column = [o[pos] for o in outputs if len(o) > pos]
        if len(column) >= 2:
            fracs.append(len(set(column)) / len(column))
    return statistics.fmean(fracs) if fracs else None


# --- metrics ---------------------------------------------------------------------------------------

def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else float("inf")


def static_metrics(run: dict, workload: str) -> dict:
    """Metrics of a static batch (``prefill`` or ``decode``) from one run's per-request times."""
    reqs = run["requests"]
    c = len(reqs)
    prompt_len = reqs[0]["prompt_len"]
    ttft = max(r["first_token_s"] for r in reqs)
    if workload == "prefill":
        return {"ttft_s": ttft, "prefill_tok_s": _rate(c * prompt_len, ttft)}
    n = min(r["num_tokens"] for r in reqs)
    t_1 = max(r["first_token_s"] for r in reqs)
    t_n = max(r["nth_token_s"] for r in reqs)
    e2e = max(r["last_token_s"] for r in reqs)
    out = {"ttft_s": ttft, "decode_tok_s": _rate(c * (n - 1), t_n - t_1), "e2e_s": e2e,
           "total_tok_s": _rate(c * (prompt_len + n), e2e), "output_tok_s": _rate(c * n, e2e),
           "request_throughput": _rate(c, e2e)}
    if "distinct_token_frac" in run:
        out["distinct_token_frac"] = run["distinct_token_frac"]
    return out


def mixed_metrics(run: dict) -> dict:
    reqs = run["requests"]
    e2e = max(r["last_token_s"] for r in reqs)
    out_tokens = sum(r["num_tokens"] for r in reqs)
    in_tokens = sum(r["prompt_len"] for r in reqs)
    late = [r for r in reqs if not r["initial"]] or reqs
    return {"ttft_s": statistics.fmean(r["first_token_s"] - r["arrival_s"] for r in late), "e2e_s": e2e,
            "total_tok_s": _rate(in_tokens + out_tokens, e2e), "output_tok_s": _rate(out_tokens, e2e),
            "request_throughput": _rate(len(reqs), e2e)}


def shared_prefix_metrics(run: dict) -> dict:
    reqs = run["requests"]
    out = mixed_metrics(run)
    out["ttft_s"] = statistics.fmean(r["first_token_s"] - r["arrival_s"] for r in reqs)
    if all(r.get("cached_tokens") is not None for r in reqs):
        out["prefix_hit_rate"] = sum(r["cached_tokens"] for r in reqs) / sum(r["prompt_len"] for r in reqs)
    return out


def run_metrics(run: dict, workload: str) -> dict:
    if workload == "shared-prefix":
        return shared_prefix_metrics(run)
    return mixed_metrics(run) if workload == "mixed" else static_metrics(run, workload)


def summarize(case: WorkloadCase, runs: list[dict]) -> dict:
    """One result row: the median of every metric over the runs, and the raw runs."""
    keys = [k for k in runs[0]["metrics"]]
    row = {"workload": case.workload, "concurrency": case.concurrency, "prompt_len": case.prompt_len,
           "output_len": case.output_len}
    for k in keys:
        row[k] = statistics.median(r["metrics"][k] for r in runs)
    row["runs"] = runs
    return row


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class CellClock:
    """The time spent on a list of cells and an estimate of what is left: the mean time of the cells done,
    times the cells to go (``cell 3/12 decode c=8: 1 min 02 s elapsed, about 3 min 06 s left``)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float | None:
        return None if self.done == 0 else self.elapsed() / self.done * (self.total - self.done)

    def start_line(self, case: "WorkloadCase") -> str:
        left = self.remaining()
        eta = "estimating the time left" if left is None else f"about {_duration(left)} left"
        return (f"cell {self.done + 1}/{self.total} {case.workload} c={case.concurrency}: "
                f"{_duration(self.elapsed())} elapsed, {eta}")

    def finished(self) -> None:
        self.done += 1


def run_case(adapter: EngineAdapter, case: WorkloadCase, vocab_size: int, runs: int, warmup_runs: int,
             log: Callable[[str], None] = lambda s: None) -> dict:
    """Warm up, then time ``runs`` runs of one cell; returns the result row."""
    for w in range(warmup_runs):
        run_once(adapter, case, make_requests(case, -1 - w, vocab_size))
    timed = []
    for i in range(runs):
        run = run_once(adapter, case, make_requests(case, i, vocab_size))
        run["metrics"] = run_metrics(run, case.workload)
        timed.append(run)
    row = summarize(case, timed)
    gc_s = max(run["gc"]["seconds"] for run in timed) if timed else 0.0
    log(f"{case.workload:>7} c={case.concurrency:<3} " + "  ".join(
        f"{k}={row[k]:.4g}" for k in ("ttft_s", "decode_tok_s", "prefill_tok_s", "total_tok_s") if k in row)
        + (f"  gc up to {gc_s * 1e3:.1f} ms in a run" if gc_s >= 1e-3 else ""))
    return row
