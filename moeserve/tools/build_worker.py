"""Builds FlashInfer modules in a process whose environment was set before FlashInfer was imported.

``moeserve precompile`` runs ``python -m moeserve.tools.build_worker`` with FlashInfer's variables
(``FLASHINFER_WORKSPACE_BASE``, ``FLASHINFER_CUDA_ARCH_LIST``, ``CUDA_HOME``, extra flags) in its
environment and a JSON request on stdin::

    {"base": DIR, "modules": [KernelModule.to_json(), ...], "jobs": 16, "parallel": 4, "dry_run": false,
     "force": false, "adopt": false, "manifest_modules": {name: manifest entry}}

and reads one line per event on stdout, each ``@@moeserve {json}``:
``{"event": "planned", "key", "name", "so", "status": cached|missing|stale|failed, ...}`` for every module,
then ``{"event": "done", "key", "name", "so", "status": built|cached|failed, "seconds", "bytes", "sha256",
"error"}``.

Modules build concurrently, each with ``spec.build()`` in its own thread. Compile jobs are shared out as
slots: a module takes at most as many ninja jobs as it has sources and as slots are free, largest modules
first (a module with more sources than half the slots leaves a quarter to the others), so small
single-file modules fill the cores a large module leaves idle.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from pathlib import Path

from moeserve.kernel_cache.layout import cached_status, sha256_file
from moeserve.kernel_cache.modules import make_spec

EVENT_PREFIX = "@@moeserve "
_emit_lock = threading.Lock()


def emit(event: dict) -> None:
    with _emit_lock:
        sys.stdout.write(EVENT_PREFIX + json.dumps(event) + "\n")
        sys.stdout.flush()


def failure_reason(exc: BaseException) -> tuple[str, str]:
    """(one line saying why, the full text) for a failed build."""
    text = "".join(traceback.format_exception_only(type(exc), exc))
    lines = text.splitlines()
    for line in lines:
        low = line.lower()
        if "error" in low and "ninja build failed" not in low and "ninja: build stopped" not in low:
            return line.strip()[:300], text
    return (lines[0].strip()[:300] if lines else type(exc).__name__), text


class JobSlots:
    """``total`` compile slots shared by the concurrent module builds."""

    def __init__(self, total: int):
        self.free = total
        self.cond = threading.Condition()

    def take(self, demand: int, reserve: int = 0) -> int:
        """Wait for a free slot, then take up to ``demand`` slots, leaving ``reserve`` for other modules."""
        with self.cond:
            while self.free < 1:
                self.cond.wait()
            k = max(1, min(demand, self.free - reserve))
            self.free -= k
            return k

    def give(self, k: int) -> None:
        with self.cond:
            self.free += k
            self.cond.notify_all()


def _patch_ninja_jobs(local: threading.local) -> None:
    """Make ninja's ``-j`` per thread: FlashInfer reads MAX_JOBS from the (process-wide) environment."""
    from flashinfer.jit import cpp_ext
    original = cpp_ext._get_num_workers

    def num_workers():
        return getattr(local, "jobs", None) or original()

    cpp_ext._get_num_workers = num_workers


def _result(module: dict, spec, status: str, seconds: float, error: str | None = None, log: str | None = None) -> dict:
    so = Path(spec.jit_library_path) if spec is not None else None
    ok = so is not None and so.is_file() and status != "failed"
    return {"event": "done", "key": module["key"], "name": spec.name if spec is not None else None,
            "so": str(so) if so else None, "status": status, "seconds": round(seconds, 2),
            "bytes": so.stat().st_size if ok else None, "sha256": sha256_file(so) if ok else None,
            "error": error, "log": log}


def build_one(module: dict, spec, slots: JobSlots, local: threading.local, reserve: int = 0) -> None:
    demand = max(1, len(spec.sources))
    k = slots.take(demand, reserve)
    local.jobs = k
    emit({"event": "started", "key": module["key"], "name": spec.name, "jobs": k})
    t0 = time.perf_counter()
    try:
        spec.build(verbose=False)
        emit(_result(module, spec, "built", time.perf_counter() - t0))
    except Exception as e:  # noqa: BLE001 - reported per module; the others carry on
        reason, text = failure_reason(e)
        emit(_result(module, spec, "failed", time.perf_counter() - t0, reason, text))
    finally:
        slots.give(k)


def run(request: dict) -> int:
    from moeserve.kernel_cache.jit_hook import ninja_is_clean

    old = request.get("manifest_modules") or {}
    pending = []
    for module in request["modules"]:
        try:
            spec = make_spec(module)
        except Exception as e:  # noqa: BLE001
            reason, text = failure_reason(e)
            emit({"event": "planned", "key": module["key"], "name": None, "so": None, "status": "failed",
                  "error": reason})
            emit(_result(module, None, "failed", 0.0, reason, text))
            continue
        so = Path(spec.jit_library_path)
        entry = old.get(spec.name)
        if request.get("force"):
            status = "missing" if not so.is_file() else "stale"
            # ninja tracks sources and flags, not the libraries a module links: without its .so it relinks
            # (and recompiles whatever else is out of date)
            so.unlink(missing_ok=True)
        elif request.get("adopt") and entry is None and so.is_file():
            status = "cached"
        else:
            clean = ninja_is_clean(spec) if so.is_file() and entry is None else None
            status = cached_status(so, entry, clean)
        emit({"event": "planned", "key": module["key"], "name": spec.name, "so": str(so), "status": status,
              "sources": len(spec.sources)})
        if status == "cached":
            done = _result(module, spec, "cached", float((entry or {}).get("seconds") or 0.0))
            emit(done)
        else:
            pending.append((module, spec))
    if request.get("dry_run") or not pending:
        return 0
    jobs = max(1, int(request.get("jobs") or 1))
    parallel = max(1, int(request.get("parallel") or 1))
    local = threading.local()
    _patch_ninja_jobs(local)
    slots = JobSlots(jobs)
    pending.sort(key=lambda item: -int(item[0].get("weight", 1)))
    gate = threading.Semaphore(parallel)
    threads = []

    def guarded(module, spec, reserve):
        try:
            build_one(module, spec, slots, local, reserve)
        finally:
            gate.release()

    for i, (module, spec) in enumerate(pending):
        # A module with many sources (the CUTLASS MoE has ~180) would take every slot for its whole build;
        # it leaves a quarter of them to the smaller modules still waiting.
        big = len(spec.sources) > jobs // 2
        reserve = jobs // 4 if big and i + 1 < len(pending) else 0
        gate.acquire()
        t = threading.Thread(target=guarded, args=(module, spec, reserve), name=f"build-{module['key']}")
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(run(json.loads(sys.stdin.read())))
