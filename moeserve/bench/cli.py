"""``moeserve bench [run|kernels|online|startup|vllm-plugin]``: the benchmark commands.

``moeserve bench`` (or ``moeserve bench run``) is the offline benchmark: the configured model under
static prefill/decode batches and a mixed workload at each concurrency, on moeserve and on each vLLM
configuration in ``bench.vllm.configs`` (each in its own worker process), with the decode roofline,
written as a table, JSON, markdown and plots. With neither ``--config`` nor ``--model`` it picks the
embedded GPU benchmark (``presets/bench-gpu.yaml``) on a CUDA machine and a short tiny-model run on
CPU. ``moeserve bench kernels`` cross-checks and times the attention (decode, prefill, and a mixed step:
one prefill plan against batched POD) and MoE kernels on the model's shapes; ``online``, ``startup`` and
``vllm-plugin`` live in their own modules. Put flags after the mode.
"""
from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
from pathlib import Path

from moeserve.args import add_config_args
from moeserve.bench.common import apply_quick, base_result, output_dir, resolve_config, say
from moeserve.config import EngineConfig

EXTERNAL_MODES = {"online": ("moeserve.bench.online", "online load generator against an OpenAI-compatible server"),
                  "startup": ("moeserve.bench.startup", "cold and warm engine start-up times"),
                  "serving": ("moeserve.bench.serving_overhead",
                              "what the server adds: offline engine vs moeserve serve (vs vLLM) TTFT/ITL in one run"),
                  "vllm-plugin": ("moeserve.bench.vllm_dummy",
                                  "write the plugin that has a vLLM you start yourself draw moeserve's dummy weights")}
VLLM_FINISH_MARGIN_S = 20.0
VLLM_MIN_S = 120.0  # below this no vLLM engine gets ready (a warm start takes about that)
VLLM_RUN_ALLOWANCE_S = 1200.0


# --- arguments -------------------------------------------------------------------------------------

def add_offline_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    g = p.add_argument_group("benchmark")
    g.add_argument("--quick", action="store_true",
                   help="1 timed run after 1 warm-up, only the lowest and highest concurrency")
    g.add_argument("--skip-vllm", action="store_true", help="moeserve only")
    g.add_argument("--only", choices=("moeserve", "vllm"), help="run only this engine (default: both)")
    g.add_argument("--vllm-config", action="append", default=[], metavar="NAME",
                   help="vLLM configuration to run (repeatable; default: bench.vllm.configs). Known: default, "
                        "flashinfer, flashinfer-attention, triton-moe")
    g.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help="finish within this many seconds: vLLM start timeouts are cut to what is left, and a "
                        "configuration that cannot start in time is reported as unavailable (default: no limit)")
    g.add_argument("--output-dir", metavar="DIR", help="write here (default: bench.output_dir/<timestamp>)")
    g.add_argument("--merge", action="append", default=[], metavar="RESULT.json",
                   help="add the engines of an earlier result file (same workloads) to this report (repeatable)")
    g.add_argument("--vllm-together", action="store_true",
                   help="start every vLLM configuration at once (GPU memory split between them) and run their "
                        "workloads one engine at a time: the start-ups overlap, the timed runs do not")
    g.add_argument("--no-vllm-kernel-cache", action="store_true",
                   help="let vLLM compile its FlashInfer modules itself even when kernel_cache_dir is set")


def add_kernel_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    g = p.add_argument_group("kernel bench")
    g.add_argument("--quick", action="store_true", help="lowest and highest batch size only")
    g.add_argument("--batch-sizes", type=int, nargs="+", metavar="N", help="decode batch sizes (default: "
                   "bench.concurrency)")
    g.add_argument("--time-budget", type=float, metavar="SECONDS", help="skip kernels not started by then (default: no limit)")
    g.add_argument("--kernels", metavar="REGEX", help="run only the kernels whose name matches (case-insensitive "
                   "search, e.g. 'mixed' or 'decode'); the others are listed as skipped (default: all)")
    g.add_argument("--allow-slow-jit", action="store_true",
                   help="also run kernels whose FlashInfer module is not built yet and takes many minutes to "
                        "compile (the CUTLASS fused MoE)")
    g.add_argument("--output-dir", metavar="DIR", help="write here (default: bench.output_dir/<timestamp>)")


def register(subparsers, name: str, help_text: str) -> None:
    p = subparsers.add_parser(name, help=help_text, description=__doc__.split("\n\n")[1])
    add_offline_args(p)
    p.set_defaults(func=run_offline)
    modes = p.add_subparsers(dest="bench_mode", metavar="MODE", title="modes (default: run)")
    r = modes.add_parser("run", help="offline benchmark: moeserve beside vLLM (the default)")
    add_offline_args(r)
    r.set_defaults(func=run_offline)
    k = modes.add_parser("kernels", help="cross-check and time the attention and MoE kernels on the model's shapes")
    add_kernel_args(k)
    k.set_defaults(func=run_kernels)
    for mode, (module, mode_help) in EXTERNAL_MODES.items():
        _register_external(modes, mode, module, mode_help)


def _register_external(modes, mode: str, module: str, help_text: str) -> None:
    try:
        mod = importlib.import_module(module)
        add_args, run = mod.add_args, mod.run
    except (ImportError, AttributeError) as e:
        missing = isinstance(e, ModuleNotFoundError) and e.name == module
        why = (f"moeserve bench {mode} is not part of this build" if missing
               else f"moeserve bench {mode} is unavailable: {type(e).__name__}: {e}")
        p = modes.add_parser(mode, help=f"{help_text} (unavailable here)")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda args: _refuse(why))
        return
    p = modes.add_parser(mode, help=help_text)
    add_args(p)
    p.set_defaults(func=run)


def _refuse(why: str) -> int:
    print(f"error: {why}", file=sys.stderr)
    return 2


# --- the offline benchmark -------------------------------------------------------------------------

def _vllm_utilization(cfg: EngineConfig, device, log) -> tuple[float, str | None]:
    """vLLM's memory fraction, lowered (with a note) when less than that is free on the GPU now."""
    import torch
    util = cfg.bench.vllm.gpu_memory_utilization
    free, total = torch.cuda.mem_get_info(device)
    if free / total >= util + 0.01:
        return util, None
    lowered = math.floor((free / total - 0.02) * 100) / 100
    note = f"gpu_memory_utilization lowered from {util} to {lowered}: only {free / 2**30:.1f} GiB was free"
    log("vLLM: " + note)
    return lowered, note


def _wait_for_free_memory(device, wanted: int, log, timeout_s: float = 60.0) -> None:
    """A stopped worker's GPU memory comes back a moment after its processes die; wait for it."""
    import torch
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        free = torch.cuda.mem_get_info(device)[0]
        if free >= wanted:
            return
        time.sleep(1.0)
    log(f"vLLM: only {free / 2**30:.1f} GiB free {timeout_s:.0f} s after the worker stopped "
        f"(was {wanted / 2**30:.1f} GiB)")


def _run_vllm(cfg, names, cases, arch, source, device, dtype, runs, warmups, out_dir, budget_left, log,
              share_kernel_cache: bool = True, together: bool = False) -> list[dict]:
    from moeserve.bench.engine_driver import unavailable_entry
    from moeserve.bench.vllm_baseline import (VLLM_CONFIGS, hf_model_dir, run_vllm_config,
                                               run_vllm_configs_together, shared_engine_args, vllm_installed)
    entries, runnable = [], []
    for name in names:
        label = f"vllm:{name}"
        if name not in VLLM_CONFIGS:
            entries.append(unavailable_entry("vllm", label, f"unknown vLLM configuration {name!r}; known: "
                                             + ", ".join(VLLM_CONFIGS)))
        elif not vllm_installed():
            entries.append(unavailable_entry("vllm", label, "vllm is not installed here (python cannot import it)"))
        elif device.type != "cuda":
            entries.append(unavailable_entry("vllm", label,
                                             f"the vLLM baseline needs a CUDA GPU; this run is on {device}"))
        else:
            runnable.append(name)
    if not runnable:
        return entries
    import torch
    model_dir, load_format = hf_model_dir(cfg, source, out_dir)
    max_len = cfg.max_model_len or arch.max_position_embeddings
    dt = str(dtype).removeprefix("torch.")
    if together and len(runnable) > 1:
        start_timeout = cfg.bench.vllm.start_timeout_s
        deadline = start_timeout + VLLM_RUN_ALLOWANCE_S * len(runnable)
        left = budget_left()
        if left is not None:
            start_timeout, deadline = min(start_timeout, left - VLLM_FINISH_MARGIN_S), left - VLLM_FINISH_MARGIN_S
        util, note = _vllm_utilization(cfg, device, log)
        share = math.floor(util / len(runnable) * 100) / 100
        args = shared_engine_args(cfg, model_dir, load_format, dt, max_len, share)
        for entry in run_vllm_configs_together(runnable, args, cases, arch.vocab_size, runs, warmups, out_dir,
                                               start_timeout, deadline, cfg, log, share_kernel_cache):
            entry.setdefault("notes", []).append(
                f"started together with {len(runnable) - 1} other vLLM configuration(s), each with "
                f"gpu_memory_utilization {share}; workloads ran one engine at a time" + (f"; {note}" if note else ""))
            entries.append(entry)
        return entries
    for name in runnable:
        label = f"vllm:{name}"
        start_timeout = cfg.bench.vllm.start_timeout_s
        deadline = start_timeout + VLLM_RUN_ALLOWANCE_S
        left = budget_left()
        if left is not None:
            left -= VLLM_FINISH_MARGIN_S
            if left < VLLM_MIN_S:
                entries.append(unavailable_entry("vllm", label,
                                                 f"skipped: only {max(left, 0):.0f} s of --time-budget left"))
                continue
            start_timeout, deadline = min(start_timeout, left), left
        free_before = torch.cuda.mem_get_info(device)[0]
        util, note = _vllm_utilization(cfg, device, log)
        args = shared_engine_args(cfg, model_dir, load_format, dt, max_len, util)
        entry = run_vllm_config(name, args, cases, arch.vocab_size, runs, warmups, out_dir, start_timeout, deadline,
                                cfg, log, share_kernel_cache)
        _wait_for_free_memory(device, free_before - (2 << 30), log)
        if note:
            entry.setdefault("notes", []).append(note)
        entries.append(entry)
    return entries


def use_shared_checkpoint(cfg: EngineConfig, source, dtype, log):
    """With ``bench.weights: shared-checkpoint`` and a model without weights (a preset or a config-only
    directory), write (or reuse) one random checkpoint and point ``cfg`` at it, so every engine loads it; the
    model source the engines will load."""
    if cfg.bench.weights != "shared-checkpoint" or source.weights_dir is not None or cfg.load_format == "dummy":
        return source
    from moeserve.bench.checkpoint import write_random_checkpoint
    from moeserve.config import resolve_model_source
    dt = str(dtype).removeprefix("torch.")
    ckpt = Path(cfg.bench.checkpoint_dir or Path(cfg.bench.output_dir) / "checkpoints" / f"{source.name}-{dt}-seed{cfg.seed}")
    write_random_checkpoint(cfg.model, ckpt, dt, cfg.seed, log=log)
    cfg.model, cfg.load_format = str(ckpt), "safetensors"
    return resolve_model_source(cfg.model)


def shared_weights_note(cfg: EngineConfig, source) -> str:
    """``result["weights"]``: ``shared-checkpoint`` when every engine reads the same files, else ``dummy``."""
    return "shared-checkpoint" if source.weights_dir is not None and cfg.load_format != "dummy" else "dummy"


def _workloads(engine: dict) -> list[str]:
    return list(dict.fromkeys(r["workload"] for r in engine.get("results", [])))


def _merge(result: dict, others: list[tuple[str, dict]], log) -> None:
    for p, other in others:
        ours, theirs = result["config"]["bench"], other.get("config", {}).get("bench", {})
        same = all(ours.get(k) == theirs.get(k) for k in ("prompt_len", "output_len"))
        by_label = {e["label"]: e for e in result["engines"]}
        for e in other.get("engines", []):
            note = f"merged from {p}" + ("" if same else " (its prompt/output lengths differ from this run's)")
            mine = by_label.get(e["label"])
            if mine is not None and mine.get("available", True) and e.get("available", True) and not (
                    {r["workload"] for r in mine.get("results", [])} & {r["workload"] for r in e.get("results", [])}):
                # the same engine measured on other workloads (e.g. in another call): one engine, more rows
                mine["results"] = list(mine.get("results", [])) + list(e.get("results", []))
                mine["notes"] = list(mine.get("notes", [])) + [f"{note}: {', '.join(_workloads(e))}"]
                continue
            e = dict(e, label=e["label"] if mine is None else f"{e['label']} ({Path(p).stem})")
            e["notes"] = list(e.get("notes", [])) + [note]
            result["engines"].append(e)
            by_label[e["label"]] = e
        log(f"merged {len(other.get('engines', []))} engine(s) from {p}")


def run_offline(args) -> int:
    t0 = time.monotonic()
    log = say(t0)
    cfg, choice = resolve_config(args)
    if args.quick:
        apply_quick(cfg)
    log(f"bench: {choice}" + (" [--quick]" if args.quick else ""))
    from moeserve.bench.engine_driver import run_moeserve
    from moeserve.bench.report import load_result, print_result, write_json, write_result
    merged = [(p, load_result(p)) for p in args.merge]  # a bad file is refused before anything runs
    from moeserve.bench.roofline import attach_roofline_fractions, measure_copy_bandwidth, roofline_table
    from moeserve.bench.workloads import build_cases
    result, source, arch, device, dtype = base_result("offline", cfg, choice)
    source = use_shared_checkpoint(cfg, source, dtype, log)
    result["weights"] = shared_weights_note(cfg, source)
    out = output_dir(cfg, args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "result.partial.json"
    b = cfg.bench
    cases = build_cases(b)
    result["workloads"] = [c.to_dict() for c in cases]
    result["bench_settings"] = {"runs": b.runs, "warmup_runs": b.warmup_runs, "quick": bool(args.quick),
                                "time_budget_s": args.time_budget}
    log(f"bench: {len(cases)} cells ({', '.join(b.workloads)} x c={b.concurrency}), {b.runs} runs after "
        f"{b.warmup_runs} warm-up; writing to {out}")
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}[str(dtype).removeprefix("torch.")]
    try:
        bw = measure_copy_bandwidth(device)
        from moeserve.quant.config import engine_quantization
        fp8 = engine_quantization(cfg, source.config) == "fp8"
        result["roofline"] = roofline_table(arch, b.concurrency, b.prompt_len, b.output_len, bw, elem,
                                            1 if cfg.kv_cache_dtype == "fp8" else elem, 1 if fp8 else elem)
        log(f"roofline: copy bandwidth {bw['bytes_per_s'] / 1e9:,.1f} GB/s on {device}")
    except Exception as e:
        result["roofline"] = {"error": f"{type(e).__name__}: {e}"}
        log(f"roofline: bandwidth measurement failed: {e!r}")
    write_json(result, partial)

    def with_partial(entry_so_far: dict) -> None:
        write_json(dict(result, engines=result["engines"] + [entry_so_far]), partial)

    moeserve_ok = True
    if args.only != "vllm":
        entry = run_moeserve(cfg, cases, b.runs, b.warmup_runs, log, on_row=with_partial)
        moeserve_ok = entry["available"]
        result["engines"].append(entry)
        write_json(result, partial)
    names = [] if (args.skip_vllm or args.only == "moeserve" or (not b.vllm.enabled and not args.vllm_config)) \
        else (args.vllm_config or list(b.vllm.configs))
    budget_left = (lambda: None) if args.time_budget is None else (lambda: args.time_budget - (time.monotonic() - t0))
    for entry in _run_vllm(cfg, names, cases, arch, source, device, dtype, b.runs, b.warmup_runs, out,
                           budget_left, log, share_kernel_cache=not args.no_vllm_kernel_cache,
                           together=args.vllm_together):
        result["engines"].append(entry)
        write_json(result, partial)
    _merge(result, merged, log)
    if "per_concurrency" in result.get("roofline", {}):
        attach_roofline_fractions(result["engines"], result["roofline"])
    result["wall_seconds"] = time.monotonic() - t0
    paths = write_result(result, out, "result")
    partial.unlink(missing_ok=True)
    print_result(result)
    log("wrote " + ", ".join(paths.values()))
    return 0 if moeserve_ok else 1


def run_kernels(args) -> int:
    from moeserve.bench import kernels
    return kernels.run(args)
