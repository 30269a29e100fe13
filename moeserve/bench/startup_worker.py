"""``python -m moeserve.bench.startup_worker --spec SPEC.json --out STATE.json``: one timed engine start.

Starts moeserve's ``LLMEngine`` or vLLM's ``LLM`` in this fresh process, then serves one request (a short
token-id prompt, one output token). Times are seconds since this module began executing: ``import_seconds``
(moeserve/torch or vLLM imported), ``ready_seconds`` (engine constructed), ``first_token_seconds`` (the
request's token back); ``ttft_seconds`` is the request alone. Then, for each concurrency ``c`` of
``spec["concurrency"]``, a batch of ``c`` new prompts (first request at that size: whatever the engine still had
to compile or build for it lands here) and a second batch of new prompts (steady state): ``probes``. For
moeserve it also records every FlashInfer module load (``moeserve.kernel_cache.jit_events``) and every Triton
kernel compile (``moeserve.kernel_cache.triton_cache``): which compiled and for how long.

The state file is rewritten at each phase (``status``: importing, starting, ready, done, failed), so the
parent keeps what was measured when it has to stop a start that takes too long.
"""
import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402


def since_start() -> float:
    return round(time.perf_counter() - T0, 3)


def write_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(state, indent=1, default=str))
    os.replace(tmp, path)


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def batch_ttft(adapter, prompts: list[list[int]], tag: str) -> float:
    """Seconds until every one of ``prompts`` (added at once, one output token each) has its token."""
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        adapter.add(f"{tag}-{i}", p, 1)
    pending = {f"{tag}-{i}" for i in range(len(prompts))}
    while pending:
        for rid, n, done in adapter.step():
            if n >= 1 or done:
                pending.discard(rid)
    _sync()
    return round(time.perf_counter() - t0, 4)


def run_probes(adapter, spec: dict, vocab: int, kernel_loads=None) -> list[dict]:
    """For each concurrency: the TTFT of the first batch of that size and of a second one (steady state);
    with ``kernel_loads`` (a count of kernels loaded so far), how many the first batch loaded."""
    import random
    rng = random.Random(0)
    n = len(spec["prompt_token_ids"])
    rows = []
    for c in spec.get("concurrency", []):
        batches = [[[rng.randrange(10, max(11, vocab)) for _ in range(n)] for _ in range(c)] for _ in range(2)]
        loaded = kernel_loads() if kernel_loads else 0
        first = batch_ttft(adapter, batches[0], f"first-c{c}")
        loaded = kernel_loads() - loaded if kernel_loads else None
        steady = batch_ttft(adapter, batches[1], f"steady-c{c}")
        rows.append({"concurrency": c, "first_ttft_s": first, "steady_ttft_s": steady,
                     "first_over_steady": round(first / steady, 3) if steady else None,
                     "first_kernel_loads": loaded})
    return rows


def compile_counts() -> dict:
    from moeserve.kernel_cache import jit_events, startup_summary
    from moeserve.kernel_cache.triton_cache import triton_events, triton_summary
    return {"jit_events": jit_events(), "flashinfer": startup_summary(), "triton_events": triton_events(),
            "triton": triton_summary()}


def run_moeserve(spec: dict, out: Path, state: dict) -> None:
    import torch  # noqa: F401

    from moeserve.bench.engine_driver import MoeserveAdapter
    from moeserve.config import EngineConfig
    from moeserve.engine.engine import LLMEngine
    from moeserve.engine.sampling_params import SamplingParams

    state.update(status="starting", import_seconds=since_start())
    write_state(out, state)
    engine = LLMEngine(EngineConfig(**spec["config"]))
    at_ready = compile_counts()
    state.update(status="ready", ready_seconds=since_start(), describe=engine.describe(),
                 kernel_cache=getattr(engine.runner, "kernel_cache", None),
                 jit_events_at_ready=at_ready["jit_events"], flashinfer_at_ready=at_ready["flashinfer"],
                 triton_events_at_ready=at_ready["triton_events"], triton_at_ready=at_ready["triton"])
    write_state(out, state)
    t_req = time.perf_counter()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    engine.add_request(list(spec["prompt_token_ids"]), params)
    while engine.has_unfinished():
        engine.step()
    _sync()
    state.update(first_token_seconds=since_start(), ttft_seconds=round(time.perf_counter() - t_req, 3))
    write_state(out, state)
    from moeserve.kernel_cache.triton_cache import triton_events
    state.update(status="done", probes=run_probes(MoeserveAdapter(engine), spec, engine.arch.vocab_size,
                                                  kernel_loads=lambda: len(triton_events())),
                 **compile_counts())


def run_vllm(spec: dict, out: Path, state: dict) -> None:
    """vLLM's start through ``LLMEngine`` and one request stepped to its first token: the same path the
    offline benchmark's vLLM worker takes (``moeserve.bench.vllm_worker``)."""
    import vllm
    from vllm import SamplingParams

    from moeserve.bench.vllm_worker import VllmAdapter, make_engine

    state.update(status="starting", import_seconds=since_start(), versions={"vllm": getattr(vllm, "__version__", None)})
    write_state(out, state)
    engine = VllmAdapter(make_engine(spec["engine_args"]), SamplingParams)
    state.update(status="ready", ready_seconds=since_start())
    write_state(out, state)
    t_req = time.perf_counter()
    engine.add("startup-0", list(spec["prompt_token_ids"]), 1)
    while not any(done or n >= 1 for _, n, done in engine.step()):
        pass
    _sync()
    state.update(first_token_seconds=since_start(), ttft_seconds=round(time.perf_counter() - t_req, 3))
    write_state(out, state)
    state.update(status="done", probes=run_probes(engine, spec, spec.get("vocab_size", 32000)))


def run(spec: dict, out: Path) -> int:
    state = {"engine": spec["engine"], "mode": spec.get("mode"), "status": "importing", "pid": os.getpid()}
    write_state(out, state)
    try:
        (run_vllm if spec["engine"] == "vllm" else run_moeserve)(spec, out, state)
    except BaseException as e:  # noqa: BLE001 - reported to the parent through the state file
        state.update(status="failed", reason=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc(limit=20))
        if spec["engine"] == "moeserve":
            try:
                state.update(compile_counts())
            except Exception:  # noqa: BLE001
                pass
        write_state(out, state)
        print(state["traceback"], file=sys.stderr, flush=True)
        return 1
    write_state(out, state)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moeserve.bench.startup_worker", description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(json.loads(Path(args.spec).read_text()), Path(args.out))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # vLLM's engine-core process can hold interpreter shutdown; the parent reaps the group
