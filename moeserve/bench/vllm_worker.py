"""``python -m moeserve.bench.vllm_worker --spec SPEC.json --out RESULT.json``: one vLLM configuration in
its own process, driven through the same workload loop as moeserve.

The spec (written by :mod:`moeserve.bench.vllm_baseline`) holds vLLM's ``EngineArgs``, the workload
cells, the vocabulary size and the run counts. The engine is vLLM's ``LLMEngine`` (``add_request`` /
``step``), with token-id prompts and ``SamplingParams(temperature=0, ignore_eos=True, max_tokens=...,
detokenize=False)``. The result file is rewritten after every step of progress (``status``: importing,
starting, ready, done or failed), so the parent can tell when the engine is ready and keep whatever was
measured if it has to stop the worker.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from moeserve.bench.workloads import CellClock, WorkloadCase, run_case


def write_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(state, indent=1, default=str))
    os.replace(tmp, path)


def say(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def device_memory_used() -> dict | None:
    """GPU memory in use on the first visible GPU, from nvidia-smi (no CUDA context in this process)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        first = out.stdout.strip().splitlines()[0]
        used, total = (float(x) for x in first.split(","))
        return {"device_used_bytes": int(used * (1 << 20)), "device_total_bytes": int(total * (1 << 20))}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


class VllmAdapter:
    """vLLM's ``LLMEngine`` behind the workload driver's ``add`` / ``step`` interface."""

    def __init__(self, engine, sampling_params_cls):
        self.engine = engine
        self._params = sampling_params_cls
        self._known: set[str] = set()
        self._alias: dict[str, str] = {}
        self._tokens: dict[str, list[int]] = {}
        self._cached: dict[str, int | None] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        params = self._params(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, detokenize=False)
        internal = self.engine.add_request(request_id, {"prompt_token_ids": list(prompt_token_ids)}, params)
        self._known.add(request_id)
        if isinstance(internal, str) and internal != request_id:
            self._alias[internal] = request_id

    def _resolve(self, rid: str) -> str:
        if rid in self._known:
            return rid
        if rid not in self._alias:
            match = [k for k in self._known if rid.startswith(k)]
            self._alias[rid] = match[0] if match else rid
        return self._alias[rid]

    def step(self) -> list[tuple[str, int, bool]]:
        out = []
        for o in self.engine.step():
            comp = o.outputs[0] if getattr(o, "outputs", None) else None
            rid = self._resolve(o.request_id)
            if comp is not None:
                self._tokens[rid] = list(comp.token_ids)
            if o.finished:
                self._cached[rid] = getattr(o, "num_cached_tokens", None)
            out.append((rid, len(comp.token_ids) if comp is not None else 0, bool(o.finished)))
        return out

    def num_cached_tokens(self, request_id: str) -> int | None:
        """Prompt tokens vLLM found in its prefix cache (``RequestOutput.num_cached_tokens``)."""
        return self._cached.pop(request_id, None)

    def output_token_ids(self, request_id: str) -> list[int] | None:
        """The tokens the request generated (vLLM's default output kind is cumulative); forgotten once read."""
        return self._tokens.pop(request_id, None)


def make_engine(engine_args: dict):
    from vllm import EngineArgs
    try:
        from vllm import LLMEngine
    except ImportError:
        from vllm.v1.engine.llm_engine import LLMEngine
    try:
        from vllm.usage.usage_lib import UsageContext
    except ImportError:
        return LLMEngine.from_engine_args(EngineArgs(**engine_args))
    return LLMEngine.from_engine_args(EngineArgs(**engine_args), usage_context=UsageContext.LLM_CLASS)


def run(spec: dict, out: Path) -> int:
    name = spec["name"]
    state = {"config": name, "status": "importing", "available": None, "reason": None, "results": [],
             "notes": [], "engine_args": spec["engine_args"], "pid": os.getpid()}
    write_state(out, state)
    t0 = time.perf_counter()
    try:
        import vllm
        from vllm import SamplingParams
    except Exception as e:
        state.update(status="failed", available=False, reason=f"vllm is not importable: {type(e).__name__}: {e}")
        write_state(out, state)
        return 0
    state.update(status="starting", import_seconds=time.perf_counter() - t0,
                 versions={"vllm": getattr(vllm, "__version__", None)})
    write_state(out, state)
    say(f"vllm:{name}: vllm {state['versions']['vllm']} imported in {state['import_seconds']:.1f} s; "
        f"starting the engine with {spec['engine_args']}")
    t1 = time.perf_counter()
    try:
        engine = make_engine(spec["engine_args"])
    except Exception as e:
        state.update(status="failed", available=False, reason=f"engine failed to start: {type(e).__name__}: {e}",
                     traceback=traceback.format_exc(limit=12))
        write_state(out, state)
        say(f"vllm:{name}: engine failed to start: {e!r}")
        return 1
    state.update(status="ready", available=True, start_seconds=time.perf_counter() - t1,
                 memory=device_memory_used())
    write_state(out, state)
    say(f"vllm:{name}: ready in {state['start_seconds']:.1f} s")
    gate = spec.get("gate")
    if gate:  # started beside other engines: wait until it is this one's turn to run its workloads
        say(f"vllm:{name}: waiting for its turn")
        while not Path(gate).exists():
            time.sleep(0.2)
    adapter = VllmAdapter(engine, SamplingParams)
    clock = CellClock(len(spec["cases"]))
    for case_dict in spec["cases"]:
        case = WorkloadCase(**case_dict)
        say(f"vllm:{name}: {clock.start_line(case)}")
        try:
            row = run_case(adapter, case, spec["vocab_size"], spec["runs"], spec["warmup_runs"],
                           log=lambda s: say(f"vllm:{name}: {s}"))
        except Exception as e:
            state["notes"].append(f"{case.workload} c={case.concurrency} failed: {type(e).__name__}: {e}")
            state["traceback"] = traceback.format_exc(limit=12)
            say(f"vllm:{name}: {state['notes'][-1]}")
            break
        clock.finished()
        state["results"].append(row)
        write_state(out, state)
    state["status"] = "done"
    write_state(out, state)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moeserve.bench.vllm_worker", description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, help="worker spec (JSON) written by moeserve bench")
    ap.add_argument("--out", required=True, help="where to write the result JSON")
    args = ap.parse_args(argv)
    return run(json.loads(Path(args.spec).read_text()), Path(args.out))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's engine-core process can hold interpreter shutdown; the parent reaps the process group.
    os._exit(code)
