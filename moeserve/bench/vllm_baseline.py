"""vLLM as the baseline: each named configuration runs in its own worker process
(``python -m moeserve.bench.vllm_worker``) on the same HF config, dtype, limits and token-id prompts as
moeserve, and comes back as one engine entry of the report.

The worker's output goes to ``vllm-<name>.log`` in the output directory; the lines that say which
attention and MoE backends vLLM picked ("Using ... backend", "Using default MoE config") and its
memory figures are read back from it. A configuration that is unknown, cannot import vLLM, does not
become ready within its start timeout, or crashes gets ``available: false`` and a reason; the worker's
whole process group is stopped on timeout.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import moeserve
from moeserve.bench.engine_driver import unavailable_entry
from moeserve.bench.vllm_dummy import write_plugin_dist
from moeserve.bench.workloads import WorkloadCase
from moeserve.config import EngineConfig

# Named vLLM configurations: extra EngineArgs on top of the shared ones.
VLLM_CONFIGS: dict[str, dict] = {
    "default": {},
    "flashinfer": {"attention_backend": "FLASHINFER", "moe_backend": "flashinfer_cutlass"},
    "flashinfer-attention": {"attention_backend": "FLASHINFER"},
    "triton-moe": {"moe_backend": "triton"},
}

POLL_S = 1.0
KILL_GRACE_S = 10.0
ECHO = re.compile(r"\[bench\]|Using |backend|MoE config|Error|ERROR|Traceback|took|KV cache|compile", re.I)
GIB = 1 << 30
MEMORY_PATTERNS = {
    "weights_bytes": r"Model loading took ([\d.]+) ?GiB",
    "kv_cache_bytes": r"Available KV cache memory: ([\d.]+) ?GiB",
    "activation_peak_bytes": r"(?:torch peak memory increase:? ?|peak_torch_memory=)([\d.]+) ?GiB",
    "non_torch_bytes": r"(?:non-torch memory:? ?|non_torch_memory=)([\d.]+) ?GiB",
    "graph_bytes": r"Graph capturing finished in [\d.]+ secs?, took ([\d.]+) ?GiB",
}
STARTUP_PATTERNS = {
    "model_load_seconds": r"Model loading took [\d.]+ ?GiB (?:memory )?and ([\d.]+) seconds",
    "torch_compile_seconds": r"torch\.compile takes ([\d.]+) ?s in total",
    "graph_capture_seconds": r"Graph capturing finished in ([\d.]+) secs?",
    "init_engine_seconds": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) seconds",
}


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def parse_log(text: str) -> dict:
    """Backends, notes, memory and start-up phases vLLM logged (best effort; absent lines are left out)."""
    backends: dict[str, str] = {}
    m = re.search(r"Using (\w+) attention backend", text)
    if m:
        backends["attention"] = m.group(1)
    m = re.search(r"Using '?(\w+)'?(?: [\w-]+)? (?:MoE|moe) backend", text)
    if m:
        backends["moe"] = m.group(1)
    m = re.search(r"Using FlashAttention version (\d+)", text)
    if m and backends.get("attention") == "FLASH_ATTN":
        backends["attention"] = f"FLASH_ATTN (FA{m.group(1)})"
    notes = []
    for line in text.splitlines():
        if ("Using " in line and ("backend" in line or "FlashAttention version" in line)) or "MoE config" in line:
            note = re.sub(r"^.*?\] ", "", line.strip())[:300]
            if note not in notes:
                notes.append(note)
    if any("Using default MoE config" in n for n in notes):
        backends.setdefault("moe_config", "default (no tuned config for this shape on this GPU)")
    memory = {k: int(float(m.group(1)) * GIB) for k, p in MEMORY_PATTERNS.items() if (m := re.search(p, text))}
    m = re.search(r"GPU KV cache size: ([\d,]+) tokens", text)
    if m:
        memory["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
    startup = {k: float(m.group(1)) for k, p in STARTUP_PATTERNS.items() if (m := re.search(p, text))}
    return {"backends": backends, "notes": notes[:30], "memory": memory, "startup": startup}


def hf_model_dir(cfg: EngineConfig, source, tmp_dir: Path) -> tuple[str, str]:
    """The directory vLLM loads (``config.json``, maybe weights) and its load format."""
    if source.config_dir is not None:
        real = source.weights_dir is not None and cfg.load_format != "dummy"
        return (source.weights_dir if real else source.config_dir), ("auto" if real else "dummy")
    d = tmp_dir / f"hf-config-{source.name}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(source.config, indent=1))
    return str(d), "dummy"


def shared_engine_args(cfg: EngineConfig, model_dir: str, load_format: str, dtype: str, max_model_len: int,
                       gpu_memory_utilization: float) -> dict:
    """EngineArgs every configuration shares: the same model, dtype and limits as moeserve."""
    args = {"model": model_dir, "load_format": load_format, "skip_tokenizer_init": True, "dtype": dtype,
            "enable_prefix_caching": cfg.enable_prefix_caching, "max_model_len": max_model_len, "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens, "gpu_memory_utilization": gpu_memory_utilization,
            "seed": cfg.seed, "disable_log_stats": True}
    if cfg.enforce_eager:
        args["enforce_eager"] = True
    if cfg.tensor_parallel_size > 1:  # the same GPUs and split as moeserve's
        args["tensor_parallel_size"] = cfg.tensor_parallel_size
        args["enable_expert_parallel"] = cfg.enable_expert_parallel
    if cfg.quantization == "fp8":
        args["quantization"] = "fp8"  # vLLM's own FP8 (online, per-tensor); moeserve's is 128x128 block FP8
    if cfg.kv_cache_dtype == "fp8":
        args["kv_cache_dtype"] = "fp8"
    return args


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the worker and everything it started (its own session, so its own process group)."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            try:  # the worker is gone; its engine-core child may not be
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return


def _read_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


SITECUSTOMIZE = '''"""Written by moeserve bench: load FlashInfer modules from a moeserve kernel cache in every process
of a vLLM baseline worker (vLLM's engine core runs in a child process)."""
import os

if os.environ.get("MOESERVE_VLLM_KERNEL_CACHE"):
    try:
        from moeserve.kernel_cache import jit_hook, use_kernel_cache
        use_kernel_cache(os.environ["MOESERVE_VLLM_KERNEL_CACHE"], None)
        jit_hook.install()
    except Exception as e:
        print(f"[bench] moeserve kernel cache not used in pid {os.getpid()}: {e!r}", flush=True)
'''


def worker_env(cfg: EngineConfig, out_dir: Path, share_kernel_cache: bool,
               dummy_weights: bool = False) -> tuple[dict, str | None]:
    """The worker's environment, and a note saying what it changes in vLLM.

    With ``kernel_cache_dir`` set (and ``share_kernel_cache``), every process of the worker loads the
    FlashInfer modules that cache holds (the same FlashInfer version and GPU architecture) instead of
    compiling them again; what is not in it, FlashInfer compiles as usual. With ``dummy_weights`` and
    ``bench.vllm.dummy_init: moeserve``, vLLM draws its random weights by moeserve's rule
    (:mod:`moeserve.bench.vllm_dummy`).
    """
    env = dict(os.environ)
    paths = [str(Path(moeserve.__file__).resolve().parent.parent)]
    notes = []
    site = out_dir / "vllm-site"
    if cfg.kernel_cache_dir and share_kernel_cache:
        cache = str(Path(cfg.kernel_cache_dir).expanduser().resolve())
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env["MOESERVE_VLLM_KERNEL_CACHE"] = cache
        env["FLASHINFER_WORKSPACE_BASE"] = cache
        notes.append(f"FlashInfer modules in moeserve's kernel cache ({cache}) were loaded from it, not compiled again")
    if dummy_weights and cfg.bench.vllm.dummy_init == "moeserve":
        write_plugin_dist(site)
        notes.append("dummy weights drawn by moeserve's rule (bench.vllm.dummy_init: moeserve): N(0, "
                     "initializer_range), unit norms, block-FP8 quantised from bf16 draws")
    if site.is_dir():
        paths.insert(0, str(site))
    note = "; ".join(notes) or None
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local directory; never wait on the network
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return env, note


class Worker:
    """A running vLLM worker process: its files, its log tail, and the gate it waits at once ready."""

    def __init__(self, name: str, engine_args: dict, cases: list[WorkloadCase], vocab_size: int, runs: int,
                 warmup_runs: int, out_dir: Path, cfg: EngineConfig, log: Callable[[str], None],
                 share_kernel_cache: bool = True, gated: bool = False):
        self.name, self.label, self.log = name, f"vllm:{name}", log
        self.args = dict(engine_args, **VLLM_CONFIGS[name])
        self.num_cases = len(cases)
        self.spec_path, self.out_path, self.log_path = (out_dir / f"vllm-{name}.spec.json",
                                                        out_dir / f"vllm-{name}.json", out_dir / f"vllm-{name}.log")
        self.gate = out_dir / f"vllm-{name}.go" if gated else None
        if self.gate is not None:
            self.gate.unlink(missing_ok=True)
        spec = {"name": name, "engine_args": self.args, "cases": [c.to_dict() for c in cases],
                "vocab_size": vocab_size, "runs": runs, "warmup_runs": warmup_runs,
                "gate": str(self.gate) if self.gate else None}
        self.spec_path.write_text(json.dumps(spec, indent=1))
        self.out_path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "moeserve.bench.vllm_worker", "--spec", str(self.spec_path),
               "--out", str(self.out_path)]
        env, self.cache_note = worker_env(cfg, out_dir, share_kernel_cache,
                                          dummy_weights=self.args.get("load_format") == "dummy")
        self.t0 = time.monotonic()
        self.logf = open(self.log_path, "w")
        self.tail = open(self.log_path, "r", errors="replace")
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)
        self.reason: str | None = None
        self.ready = False

    def echo(self) -> None:
        for line in self.tail.readlines():
            if ECHO.search(line):
                self.log(f"{self.label} | {line.rstrip()[:240]}")

    def poll(self, start_timeout_s: float) -> bool:
        """One look at the worker; True while it is still starting."""
        self.echo()
        if self.proc.poll() is not None:
            return False
        self.ready = self.ready or _read_state(self.out_path).get("status") in ("ready", "done")
        if not self.ready and time.monotonic() - self.t0 > start_timeout_s:
            self.reason = f"not ready within {start_timeout_s:.0f} s (bench.vllm.start_timeout_s or --time-budget)"
            return False
        return not self.ready

    def wait_ready(self, start_timeout_s: float) -> None:
        while self.poll(start_timeout_s):
            time.sleep(POLL_S)

    def finish(self, deadline_s: float) -> dict:
        """Open the gate (if any), follow the worker to the end of its cases or the deadline; its entry."""
        if self.gate is not None and self.ready and self.reason is None:
            self.gate.touch()
        while self.reason is None and self.proc.poll() is None:
            self.echo()
            if time.monotonic() - self.t0 > deadline_s:
                self.reason = f"stopped at its deadline ({deadline_s:.0f} s, --time-budget)"
                break
            time.sleep(POLL_S)
        _kill_group(self.proc)
        self.echo()
        self.logf.close()
        self.tail.close()
        return self._entry(time.monotonic() - self.t0)

    def _entry(self, wall: float) -> dict:
        label, log_path = self.label, self.log_path
        state = _read_state(self.out_path)
        parsed = parse_log(log_path.read_text(errors="replace"))
        extra = {"engine_args": self.args, "log": log_path.name, "worker_seconds": wall,
                 "notes": parsed["notes"] + state.get("notes", []) + ([self.cache_note] if self.cache_note else [])}
        if not state.get("available"):
            why = self.reason or state.get("reason")
            if why is None:
                last = [l for l in log_path.read_text(errors="replace").splitlines() if l.strip()][-3:]
                why = (f"worker exited with code {self.proc.returncode} before the engine was ready: "
                       + " | ".join(last)[-400:])
            self.log(f"{label}: unavailable: {why}")
            return unavailable_entry("vllm", label, why, backends=parsed["backends"], **extra)
        done = len(state.get("results", []))
        if self.reason:
            extra["notes"].append(f"{self.reason}; {done} of {self.num_cases} cells measured")
        elif self.proc.returncode not in (0, None, -signal.SIGTERM, -signal.SIGKILL) or done < self.num_cases:
            extra["notes"].append(f"worker exited with code {self.proc.returncode} after {done} of "
                                  f"{self.num_cases} cells")
        memory = dict(parsed["memory"], **(state.get("memory") or {}))
        self.log(f"{label}: done in {wall:.0f} s, {done} of {self.num_cases} cells")
        return {"name": "vllm", "label": label, "available": True, "reason": None, "backends": parsed["backends"],
                "start_seconds": state.get("start_seconds"),
                "startup": dict(parsed["startup"], import_seconds=state.get("import_seconds"),
                                ready_seconds=state.get("start_seconds")),
                "memory": memory, "versions": state.get("versions"), "results": state.get("results", []), **extra}


def run_vllm_config(name: str, engine_args: dict, cases: list[WorkloadCase], vocab_size: int, runs: int,
                    warmup_runs: int, out_dir: Path, start_timeout_s: float, deadline_s: float,
                    cfg: EngineConfig, log: Callable[[str], None], share_kernel_cache: bool = True) -> dict:
    """Run one vLLM configuration in a worker; returns its engine entry."""
    if name not in VLLM_CONFIGS:
        return unavailable_entry("vllm", f"vllm:{name}", f"unknown vLLM configuration {name!r}; known: "
                                 + ", ".join(VLLM_CONFIGS))
    log(f"vllm:{name}: starting worker (start timeout {start_timeout_s:.0f} s, deadline {deadline_s:.0f} s); "
        f"log in {out_dir / f'vllm-{name}.log'}")
    w = Worker(name, engine_args, cases, vocab_size, runs, warmup_runs, out_dir, cfg, log, share_kernel_cache)
    w.wait_ready(start_timeout_s)
    return w.finish(deadline_s)


def run_vllm_configs_together(names: list[str], engine_args: dict, cases: list[WorkloadCase], vocab_size: int,
                              runs: int, warmup_runs: int, out_dir: Path, start_timeout_s: float,
                              deadline_s: float, cfg: EngineConfig, log: Callable[[str], None],
                              share_kernel_cache: bool = True) -> list[dict]:
    """Start every configuration at once (each with its share of GPU memory), then, once all are ready or
    given up on, let them run their workloads one after another, so no timed run overlaps another engine's
    work. The start-up times overlap, which is what this saves; each worker's start time is still its own."""
    workers = [Worker(n, engine_args, cases, vocab_size, runs, warmup_runs, out_dir, cfg, log, share_kernel_cache,
                      gated=True) for n in names]
    log(f"vLLM: started {', '.join(w.label for w in workers)} together (start timeout {start_timeout_s:.0f} s)")
    starting = list(workers)
    while starting:
        starting = [w for w in starting if w.poll(start_timeout_s)]
        time.sleep(POLL_S)
    return [w.finish(deadline_s) for w in workers]
