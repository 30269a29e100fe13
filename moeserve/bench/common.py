"""What every benchmark mode shares: which configuration a run takes, where it writes, the fields every result
has, and the progress log."""
from __future__ import annotations

import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from moeserve.args import overrides_from_args
from moeserve.config import EngineConfig, load_config

GPU_PRESET = Path(__file__).resolve().parent.parent / "presets" / "bench-gpu.yaml"
CPU_DEFAULTS = {"model": "tiny", "bench.prompt_len": 128, "bench.output_len": 32, "bench.concurrency": [1, 4],
                "bench.runs": 2, "bench.warmup_runs": 1}


def say(t0: float):
    def log(msg: str) -> None:
        print(f"[bench {time.monotonic() - t0:6.1f}s] {msg}", flush=True)
    return log


def resolve_config(args) -> tuple[EngineConfig, str]:
    """The run's config and a sentence saying where it came from."""
    user = overrides_from_args(args)
    if args.config or "model" in user:
        return load_config(args.config, user), f"config from {'--config ' + args.config if args.config else '--model'}"
    import torch
    if torch.cuda.is_available():
        cfg = load_config(GPU_PRESET, user)
        return cfg, (f"no --config or --model and a CUDA GPU is here: the embedded GPU benchmark "
                     f"({GPU_PRESET.name}: {cfg.model}, {cfg.load_format} weights, {cfg.dtype}, prompt "
                     f"{cfg.bench.prompt_len}, output {cfg.bench.output_len}, concurrency "
                     f"{' '.join(map(str, cfg.bench.concurrency))})")
    cfg = load_config(None, {**CPU_DEFAULTS, **user})
    return cfg, (f"no --config or --model and no GPU: the tiny preset on CPU with torch backends, lengths "
                 f"shortened for CPU (prompt {cfg.bench.prompt_len}, output {cfg.bench.output_len}, concurrency "
                 f"{' '.join(map(str, cfg.bench.concurrency))}, {cfg.bench.runs} runs)")


def apply_quick(cfg: EngineConfig) -> None:
    cs = sorted(set(cfg.bench.concurrency))
    cfg.bench.concurrency = sorted({cs[0], cs[-1]})
    cfg.bench.runs = 1
    cfg.bench.warmup_runs = 1


def output_dir(cfg: EngineConfig, explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    return Path(cfg.bench.output_dir) / datetime.now().strftime("%Y%m%d-%H%M%S")


def source_commit() -> str | None:
    """The commit of the code that runs: ``MOESERVE_COMMIT`` when set (a copy without .git), else git's HEAD
    (with ``+dirty`` when files differ from it)."""
    import os
    import subprocess
    if os.environ.get("MOESERVE_COMMIT"):
        return os.environ["MOESERVE_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def base_result(kind: str, cfg: EngineConfig, choice: str) -> tuple:
    """The fields every result has, and the model source, architecture, device and dtype they describe
    (resolved the way the engine resolves them)."""
    import moeserve
    from moeserve.plan import resolve_plan
    plan = resolve_plan(cfg, with_backends=False)
    source, arch, device, dtype = plan.source, plan.arch, plan.device, plan.dtype
    env = dict(plan.hardware.to_dict(), device=str(device))
    result = {"kind": kind, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": shlex.join(["moeserve"] + sys.argv[1:]) if sys.argv else "moeserve",
              "moeserve_version": moeserve.__version__, "commit": source_commit(), "environment": env,
              "config": cfg.model_dump(),
              "model": {"name": source.name, "model_type": arch.model_type, "dtype": str(dtype).removeprefix("torch.")},
              "config_choice": choice, "engines": []}
    return result, source, arch, device, dtype
