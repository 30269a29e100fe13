"""``moeserve bench startup``: how long an engine takes to start, cold and warm, and what FlashInfer compiled.

Each mode is a fresh process (``moeserve.bench.startup_worker``) with a timeout; it reports the time to a
ready engine and to the first token of one short request (1 output token):

- ``cold``: empty caches: a new FlashInfer workspace, Triton cache and TorchInductor cache;
- ``cache``: a copy of the precompiled kernel cache (``--kernel-cache DIR`` or ``kernel_cache_dir``; a copy,
  so the run cannot add to it), with new Triton and TorchInductor caches;
- ``warm``: a second start on the caches the ``cache`` run left (the ``cold`` run's when there was none;
  skipped when neither ran before it);
- ``vllm-cold`` / ``vllm-warm``: vLLM's engine on the same model (the same checkpoint when the model is a
  directory with weights; dummy weights for a preset); cold has a new ``VLLM_CACHE_ROOT``, FlashInfer
  workspace and Triton cache, warm starts again on them.

moeserve rows say how many FlashInfer modules and Triton kernels compiled and for how long. After the first
token each start serves, at each ``--concurrency``, a first batch of new prompts and a second one: the first
request's TTFT at that size against the steady state (``probe`` rows). The result (``kind: startup``) is
written after every mode (``startup.partial.json``), so a run stopped half-way keeps what it measured.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

MODES = ("cold", "cache", "warm", "vllm-cold", "vllm-warm")
LABELS = {"cold": "moeserve cold (empty caches)", "cache": "moeserve precompiled kernel cache",
          "warm": "moeserve warm (second start)", "vllm-cold": "vllm cold (empty caches)",
          "vllm-warm": "vllm warm (second start)"}
POLL_S = 0.5
MIN_MODE_S = 30.0


def add_args(p: argparse.ArgumentParser) -> None:
    if not any("--config" in a.option_strings for a in p._actions):
        from moeserve.args import add_config_args
        add_config_args(p)
    g = p.add_argument_group("startup bench")
    g.add_argument("--kernel-cache", metavar="DIR", help="kernel cache from `moeserve precompile` for the cache mode "
                   "(default: the config's kernel_cache_dir)")
    g.add_argument("--modes", default=",".join(MODES), help=f"which starts, in order (default {','.join(MODES)})")
    g.add_argument("--skip-vllm", action="store_true", help="no vLLM rows")
    g.add_argument("--timeout", type=float, default=900.0, metavar="S", help="per start (default 900)")
    g.add_argument("--time-budget", type=float, metavar="S", help="stop starting new modes after this many seconds (default: no limit)")
    g.add_argument("--prompt-len", type=int, default=16, help="prompt tokens of each request (default 16)")
    g.add_argument("--concurrency", default="1,8,32", metavar="C,...",
                   help="batch sizes whose first-request TTFT is compared with the steady state (default 1,8,32)")
    g.add_argument("--strict-cache", action="store_true",
                   help="allow_jit: false in the cache and warm modes: refuse to start, or fail, instead of compiling")
    g.add_argument("--output-dir", metavar="DIR", help="default: bench.output_dir/startup-<timestamp>")
    g.add_argument("--keep-temp", action="store_true", help="keep the per-mode cache directories")
    g.add_argument("--merge", action="append", default=[], metavar="STARTUP.json",
                   help="put the rows of an earlier startup result (or startup.partial.json) first, e.g. to join "
                        "runs made in separate calls (repeatable)")


def prompt_ids(n: int, vocab: int) -> list[int]:
    return [(1000 + 37 * i) % vocab for i in range(n)]


def _unavailable(mode: str, reason: str, **extra) -> dict:
    return {"name": "vllm" if mode.startswith("vllm") else "moeserve", "label": LABELS[mode], "mode": mode,
            "available": False, "reason": reason, "backends": {}, "start_seconds": None, "memory": None,
            "results": [], **extra}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        from moeserve.bench.vllm_baseline import _kill_group as kill
        kill(proc)
        return
    except ImportError:
        pass
    import os
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_worker(spec: dict, work: Path, env: dict, timeout: float) -> tuple[dict, float, str | None]:
    """Run one start; (its last state, wall seconds, why it was stopped or None)."""
    import os
    mode = spec["mode"]
    spec_path, out, log_path = work / f"{mode}.spec.json", work / f"{mode}.state.json", work / f"{mode}.log"
    spec_path.write_text(json.dumps(spec, indent=1))
    out.unlink(missing_ok=True)
    full_env = dict(os.environ, **env, PYTHONUNBUFFERED="1")
    full_env.setdefault("HF_HUB_OFFLINE", "1")  # local model directories only: never wait on a model hub
    full_env.setdefault("VLLM_NO_USAGE_STATS", "1")
    root = str(Path(__file__).resolve().parents[2])
    full_env["PYTHONPATH"] = root + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "moeserve.bench.startup_worker", "--spec", str(spec_path), "--out", str(out)]
    t0 = time.monotonic()
    stopped = None
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout:
                stopped = f"stopped after {timeout:.0f} s (--timeout)"
                break
            time.sleep(POLL_S)
        _kill_group(proc)
    wall = time.monotonic() - t0
    try:
        state = json.loads(out.read_text())
    except (OSError, ValueError):
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        state = {"status": "failed", "reason": f"worker exited with code {proc.returncode}: " + " | ".join(tail)[-600:]}
    return state, wall, stopped


def _flashinfer_figures(events: list[dict]) -> dict:
    first: dict[str, dict] = {}
    for e in events:
        first.setdefault(e["name"], e)
    compiled = [e for e in first.values() if e.get("compiled")]
    return {"modules_loaded": len(first), "modules_compiled": len(compiled),
            "compile_seconds": round(sum(e["seconds"] for e in compiled), 2),
            "compiled": [e["name"] for e in compiled],
            "sources": sorted({e["source"] for e in first.values()})}


def entry_from_state(mode: str, state: dict, wall: float, stopped: str | None, prompt_len: int, extra: dict) -> dict:
    """One engine entry of the report from a worker's state."""
    ready, first = state.get("ready_seconds"), state.get("first_token_seconds")
    if ready is None:
        why = stopped or state.get("reason") or f"status {state.get('status')}"
        fi = _flashinfer_figures(state.get("jit_events") or [])
        return _unavailable(mode, f"not ready: {why}", process_seconds=round(wall, 2), flashinfer=fi,
                            worker=state, **extra)
    row = {"workload": "startup", "concurrency": 1, "prompt_len": prompt_len, "output_len": 1,
           "ready_s": ready, "first_token_s": first, "ttft_s": state.get("ttft_seconds"),
           "import_s": state.get("import_seconds"), "process_s": round(wall, 2), "runs": [state]}
    entry = {"name": "vllm" if mode.startswith("vllm") else "moeserve", "label": LABELS[mode], "mode": mode,
             "available": True, "reason": None, "backends": (state.get("describe") or {}).get("backends", {}),
             "start_seconds": ready, "memory": None, "results": [row], **extra}
    if not mode.startswith("vllm"):
        fi = _flashinfer_figures(state.get("jit_events") or state.get("jit_events_at_ready") or [])
        row.update(fi_modules_compiled=fi["modules_compiled"], fi_compile_s=fi["compile_seconds"])
        entry["flashinfer"] = dict(fi, summary=state.get("flashinfer") or state.get("flashinfer_at_ready"))
        d = state.get("describe") or {}
        entry["startup"] = {k: d.get(k) for k in ("init_seconds", "load_seconds", "graph_capture_seconds",
                                                  "ready_seconds", "startup_phases", "weights_bytes")}
        _weights_rows(row, (d.get("startup_phases") or {}).get("weights"))
    if not mode.startswith("vllm"):
        triton = state.get("triton_events") or state.get("triton_events_at_ready") or []
        compiled = [e for e in triton if e.get("compiled")]
        row.update(triton_kernels_compiled=len(compiled))
        entry["triton"] = {"kernels": len(triton), "compiled": [e["name"] for e in compiled],
                           "summary": state.get("triton") or state.get("triton_at_ready")}
    for p in state.get("probes") or []:
        entry["results"].append({"workload": "first-request", "concurrency": p["concurrency"],
                                 "prompt_len": prompt_len, "output_len": 1, "ttft_s": p["first_ttft_s"],
                                 "steady_ttft_s": p["steady_ttft_s"], "first_over_steady": p["first_over_steady"],
                                 "first_kernel_loads": p.get("first_kernel_loads")})
    if first is None:
        entry["notes"] = [f"no first token: {stopped or state.get('reason')}"]
    return entry


def _weights_rows(row: dict, weights_s: float | None) -> None:
    """The weights' read time and the rest of the start (``ready_minus_weights_s``), when known."""
    if weights_s is not None and row.get("ready_s") is not None:
        row.update(weights_s=round(weights_s, 3), ready_minus_weights_s=round(row["ready_s"] - weights_s, 3))


def vllm_startup_figures(log_text: str) -> dict[str, float]:
    """vLLM's own start-up figures from its log: loading the weights, torch.compile, graph capture, engine
    set-up (those it printed)."""
    from moeserve.bench.vllm_baseline import STARTUP_PATTERNS
    out = {}
    for key, pattern in STARTUP_PATTERNS.items():
        m = re.search(pattern, log_text)
        if m:
            out[key] = float(m.group(1))
    return out


def _check_kernel_cache(path: str | None) -> str | None:
    """Why the cache mode cannot run with ``path``; None when it can."""
    if not path:
        return "no kernel cache: give --kernel-cache DIR (made by `moeserve precompile`) or set kernel_cache_dir"
    from moeserve.hardware import probe
    from moeserve.kernel_cache.layout import KernelCacheError, check_compatible, flashinfer_git_version, \
        flashinfer_version, read_manifest
    try:
        manifest = read_manifest(Path(path).expanduser())
        if manifest is None:
            return f"{path} has no manifest.json (not made by `moeserve precompile`)"
        gpu = probe().gpu
        check_compatible(manifest, path, flashinfer_version(), flashinfer_git_version(),
                         gpu.capability if gpu else None, gpu.name if gpu else "this GPU")
    except KernelCacheError as e:
        return str(e)
    return None


def _write(result: dict, out_dir: Path, final: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / "startup.partial.json"
    if not final:
        tmp = partial.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(partial)
        return
    try:
        from moeserve.bench.report import print_result, write_result
    except ImportError:
        (out_dir / "startup.json").write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps([{k: e.get(k) for k in ("label", "available", "reason", "start_seconds")}
                          for e in result["engines"]], indent=1))
    else:
        print_result(result)
        paths = write_result(result, out_dir, "startup")
        print(f"wrote {', '.join(paths.values())}")
    partial.unlink(missing_ok=True)


def run(args) -> int:
    import moeserve
    from moeserve.args import config_from_args
    from moeserve.plan import resolve_plan

    cfg = config_from_args(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if args.skip_vllm:
        modes = [m for m in modes if not m.startswith("vllm")]
    plan = resolve_plan(cfg, with_backends=False)
    hw, source, arch = plan.hardware, plan.source, plan.arch
    dtype = str(plan.dtype).removeprefix("torch.")
    ids = prompt_ids(args.prompt_len, arch.vocab_size)
    kernel_cache = args.kernel_cache or cfg.kernel_cache_dir
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.output_dir or Path(cfg.bench.output_dir) / f"startup-{stamp}")
    work = Path(tempfile.mkdtemp(prefix="moeserve-startup-"))
    result = {"kind": "startup", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": shlex.join(["moeserve"] + sys.argv[1:]), "moeserve_version": moeserve.__version__,
              "environment": hw.to_dict(), "config": cfg.model_dump(),
              "model": {"name": source.name, "model_type": arch.model_type, "dtype": dtype},
              "kernel_cache": kernel_cache, "engines": []}
    for path in args.merge:
        earlier = json.loads(Path(path).read_text())
        if earlier.get("kind") != "startup":
            raise ValueError(f"--merge: {path} is not a startup result (kind {earlier.get('kind')!r})")
        result["engines"].extend(dict(e, merged_from=str(path)) for e in earlier.get("engines", []))
    can_gpu = hw.gpu is not None or cfg.device == "cpu"
    t_start = time.monotonic()
    dirs: dict[str, dict] = {}

    def fresh(name: str) -> dict:
        d = {"FLASHINFER_WORKSPACE_BASE": work / name / "flashinfer", "TRITON_CACHE_DIR": work / name / "triton",
             "TORCHINDUCTOR_CACHE_DIR": work / name / "inductor"}
        for p in d.values():
            p.mkdir(parents=True, exist_ok=True)
        return {k: str(v) for k, v in d.items()}

    try:
        for mode in modes:
            left = (args.time_budget - (time.monotonic() - t_start)) if args.time_budget else None
            timeout = min(args.timeout, left) if left is not None else args.timeout
            extra: dict = {}
            if left is not None and left < MIN_MODE_S:
                entry = _unavailable(mode, f"skipped: --time-budget of {args.time_budget:.0f} s spent")
            elif mode.startswith("vllm") and importlib.util.find_spec("vllm") is None:
                entry = _unavailable(mode, "vllm is not installed")
            elif mode.startswith("vllm") and hw.gpu is None:
                entry = _unavailable(mode, "no CUDA GPU on this machine")
            elif not mode.startswith("vllm") and not can_gpu:
                entry = _unavailable(mode, "no CUDA GPU on this machine (use --device cpu to time a CPU start)")
            elif mode == "cache" and (why := _check_kernel_cache(kernel_cache)):
                entry = _unavailable(mode, why)
            elif mode == "warm" and not (dirs.get("cache") or dirs.get("cold")):
                entry = _unavailable(mode, "skipped: warm is a second start, so it needs a cold or cache start "
                                     "before it in the same run (e.g. --modes cache,warm)")
            else:
                spec = {"engine": "vllm" if mode.startswith("vllm") else "moeserve", "mode": mode,
                        "prompt_token_ids": ids, "vocab_size": arch.vocab_size,
                        "concurrency": [int(c) for c in args.concurrency.split(",") if c.strip()]}
                config = cfg.model_dump(exclude_unset=True)
                if mode == "cold":
                    env = dirs["cold"] = fresh("cold")
                    config["kernel_cache_dir"] = None
                elif mode == "cache":
                    env = fresh("cache")
                    copy = work / "cache" / "kernel-cache"
                    t_copy = time.monotonic()
                    shutil.copytree(Path(kernel_cache).expanduser(), copy, symlinks=True)
                    extra["copy_seconds"] = round(time.monotonic() - t_copy, 2)
                    env["FLASHINFER_WORKSPACE_BASE"] = config["kernel_cache_dir"] = str(copy)
                    dirs["cache"] = dict(env, kernel_cache_dir=str(copy))
                elif mode == "warm":
                    prev = dirs.get("cache") or dirs.get("cold")
                    env = {k: v for k, v in prev.items() if k != "kernel_cache_dir"}
                    config["kernel_cache_dir"] = prev.get("kernel_cache_dir")
                else:
                    if "vllm" not in dirs:
                        dirs["vllm"] = dict(fresh("vllm"), VLLM_CACHE_ROOT=str(work / "vllm" / "vllm-cache"))
                    env = dirs["vllm"]
                    from moeserve.bench.vllm_baseline import hf_model_dir, shared_engine_args
                    model_dir, load_format = hf_model_dir(cfg, source, work)
                    spec["engine_args"] = shared_engine_args(
                        cfg, model_dir, load_format, dtype, cfg.max_model_len or arch.max_position_embeddings,
                        cfg.bench.vllm.gpu_memory_utilization)
                if args.strict_cache and mode in ("cache", "warm"):
                    env = dict(env, FLASHINFER_DISABLE_JIT="1")
                    config["allow_jit"] = False
                spec["config"] = config
                extra["caches"] = env
                print(f"[startup] {LABELS[mode]}: starting (timeout {timeout:.0f} s)", flush=True)
                state, wall, stopped = run_worker(spec, work, env, timeout)
                entry = entry_from_state(mode, state, wall, stopped, args.prompt_len, extra)
                log = work / f"{mode}.log"
                if log.is_file():
                    out_dir.mkdir(parents=True, exist_ok=True)
                    shutil.copy(log, out_dir / f"{mode}.log")
                    if mode.startswith("vllm") and entry["available"]:
                        figures = entry["startup"] = vllm_startup_figures(log.read_text(errors="replace"))
                        _weights_rows(entry["results"][0], figures.get("model_load_seconds"))
            result["engines"] = [e for e in result["engines"]  # an earlier run's skipped row for this mode
                                 if not (e.get("merged_from") and not e["available"] and e.get("mode") == mode)]
            labels = {e["label"] for e in result["engines"]}
            n = 2
            while entry["label"] in labels:
                entry["label"] = f"{LABELS[mode]} #{n}"
                n += 1
            result["engines"].append(entry)
            _say_entry(entry)
            _write(result, out_dir, final=False)
    finally:
        if not args.keep_temp:
            shutil.rmtree(work, ignore_errors=True)
    _write(result, out_dir, final=True)
    return 0 if all(e["available"] or _skipped(e) for e in result["engines"]) else 1


def _skipped(entry: dict) -> bool:
    reason = entry.get("reason") or ""
    return any(s in reason for s in ("not installed", "no CUDA GPU", "no kernel cache", "skipped"))


def _say_entry(e: dict) -> None:
    if not e["available"]:
        print(f"[startup] {e['label']}: {e['reason']}", flush=True)
        return
    r = e["results"][0]
    fi = e.get("flashinfer") or {}
    first = f"{r['first_token_s']:.1f} s" if r.get("first_token_s") is not None else "-"
    note = f"; {fi.get('summary')}" if fi.get("summary") else ""
    note += f"; {e['triton']['summary']}" if (e.get("triton") or {}).get("summary") else ""
    for p in e["results"][1:]:
        note += (f"; c={p['concurrency']} first TTFT {p['ttft_s'] * 1e3:.1f} ms vs steady "
                 f"{p['steady_ttft_s'] * 1e3:.1f} ms")
        if p.get("first_kernel_loads") is not None:
            note += f" ({p['first_kernel_loads']} Triton kernels loaded in the first)"
    print(f"[startup] {e['label']}: ready {r['ready_s']:.1f} s, first token {first}{note}", flush=True)
