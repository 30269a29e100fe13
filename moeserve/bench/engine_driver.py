"""The moeserve side of the offline benchmark: build an ``LLMEngine`` in this process, drive the
workloads through it, and describe it (start time, memory, backends) for the report.

Engine start (weights, KV cache sizing, CUDA-graph capture) happens before anything is timed; kernel
compilation happens during the warm-up runs, which are not timed either.
"""
from __future__ import annotations

import gc
import time
import traceback
from typing import Callable

from moeserve.bench.workloads import CellClock, WorkloadCase, run_case
from moeserve.config import EngineConfig


class MoeserveAdapter:
    """``LLMEngine`` behind the workload driver's ``add`` / ``step`` interface."""

    def __init__(self, engine):
        from moeserve.engine.sampling_params import SamplingParams
        self.engine = engine
        self._params = SamplingParams
        self._seqs: dict = {}

    def add(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        params = self._params(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, detokenize=False)
        self.engine.add_request(prompt_token_ids, params, request_id=request_id)

    def step(self) -> list[tuple[str, int, bool]]:
        out = []
        for s in self.engine.step():
            self._seqs[s.request_id] = s
            out.append((s.request_id, len(s.output_token_ids), s.is_finished))
        return out

    def last_step_seconds(self) -> tuple[float, float]:
        """The last step's host time: scheduling and launching it, then waiting for and handing out tokens."""
        return self.engine.last_step_seconds

    def num_cached_tokens(self, request_id: str) -> int | None:
        """Prompt tokens the request found in the prefix cache."""
        seq = self._seqs.get(request_id)
        return None if seq is None else seq.num_cached_tokens

    def output_token_ids(self, request_id: str) -> list[int] | None:
        """The tokens the request generated; forgotten once read (one run's requests at a time)."""
        seq = self._seqs.pop(request_id, None)
        return list(seq.output_token_ids) if seq is not None else None


def unavailable_entry(name: str, label: str, reason: str, **extra) -> dict:
    return {"name": name, "label": label, "available": False, "reason": reason, "backends": {},
            "start_seconds": None, "memory": None, "results": [], **extra}


def engine_entry(engine, results: list[dict]) -> dict:
    d = engine.describe()
    return {
        "name": "moeserve", "label": "moeserve", "available": True, "reason": None,
        "backends": {**d["backends"], **({"fused": "+".join(d["fusions"])} if d.get("fusions") else {})},
        "start_seconds": d["ready_seconds"],
        "startup": {k: d[k] for k in ("init_seconds", "load_seconds", "graph_capture_seconds", "ready_seconds")},
        "memory": engine.memory_report(),
        "engine": {k: d[k] for k in ("device", "dtype", "load_format", "kv_pages", "page_size", "max_model_len",
                                     "cuda_graph_batch_sizes")},
        "stats": dict(engine.stats, preemptions=engine.scheduler.num_preemptions,
                      prefix_cache=engine.prefix_cache_stats()),
        "results": results,
    }


def free_device_memory(device) -> None:
    """Collect dropped objects and hand cached GPU memory back, so a vLLM worker started next finds it."""
    import torch
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_moeserve(cfg: EngineConfig, cases: list[WorkloadCase], runs: int, warmup_runs: int,
                 log: Callable[[str], None], on_row: Callable[[dict], None] = lambda entry: None) -> dict:
    """Start moeserve, run every case, and return its engine entry (``available: false`` on failure).

    ``on_row`` gets the entry so far after each finished cell, for writing partial results.
    """
    from moeserve.engine.engine import LLMEngine
    log("moeserve: starting the engine")
    t0 = time.perf_counter()
    try:
        engine = LLMEngine(cfg)
    except Exception as e:  # the report must stand even when our engine cannot start
        log(f"moeserve: engine failed to start: {e!r}")
        return unavailable_entry("moeserve", "moeserve", f"engine failed to start: {type(e).__name__}: {e}",
                                 traceback=traceback.format_exc(limit=8))
    d = engine.describe()
    log(f"moeserve: ready in {time.perf_counter() - t0:.1f} s on {d['device']} ({d['dtype']}), backends "
        + " ".join(f"{k}={v}" for k, v in d["backends"].items()))
    adapter = MoeserveAdapter(engine)
    vocab = engine.arch.vocab_size
    results: list[dict] = []
    failure = None
    clock = CellClock(len(cases))
    for case in cases:
        log("moeserve: " + clock.start_line(case))
        try:
            results.append(run_case(adapter, case, vocab, runs, warmup_runs, log=lambda s: log("moeserve: " + s)))
            clock.finished()
        except Exception as e:
            failure = f"{case.workload} c={case.concurrency} failed: {type(e).__name__}: {e}"
            log("moeserve: " + failure)
            break
        on_row(engine_entry(engine, results))
    entry = engine_entry(engine, results)
    if failure:
        entry["notes"] = [failure]
        entry["traceback"] = traceback.format_exc(limit=8)
    device = engine.runner.device
    engine.shutdown()  # the other ranks of a multi-GPU engine give their GPUs back
    del adapter, engine
    free_device_memory(device)
    if device.type == "cuda":
        import torch
        free, total = torch.cuda.mem_get_info(device)
        log(f"moeserve: engine released; {free / 2**30:.1f} of {total / 2**30:.1f} GiB free on {device}")
    return entry
