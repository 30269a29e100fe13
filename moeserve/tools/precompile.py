"""``moeserve precompile``: build, ahead of time and without a GPU, the FlashInfer modules and the Triton kernels
an engine configuration loads, into a kernel cache directory a GPU machine then uses as is.

    moeserve precompile --model qwen1.5-moe-a2.7b --arch 9.0a --out kernel-cache

The builds run in a subprocess (``moeserve.tools.build_worker``) because FlashInfer fixes its workspace
and target architecture when it is imported. Running it again on the same ``--out`` builds only what is
missing or stale and adds to the manifest, so one directory can serve several configurations.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from moeserve.kernel_cache.layout import (Arch, KernelCacheError, MANIFEST_FORMAT, flashinfer_git_version,
                                     flashinfer_version, parse_arch, read_manifest, workspace_dir, write_manifest)
from moeserve.tools.toolchain import ToolchainError, prepare_toolchain

DEFAULT_OUT = "kernel-cache"
SUPPORT_DIR = ".build-support"  # inside --out: the libcuda stub, build logs


def add_args(p: argparse.ArgumentParser) -> None:
    from moeserve.args import add_config_args
    add_config_args(p)
    g = p.add_argument_group("precompile")
    g.add_argument("--arch", help="target GPU architecture, e.g. 9.0a (H100/H200); default: this machine's GPU")
    g.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"kernel cache directory (a FlashInfer workspace base; default ./{DEFAULT_OUT})")
    g.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="compile processes at once, shared among the modules (default: CPU count)")
    g.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="modules built at once (default: up to --jobs / 2)")
    g.add_argument("--modules", default=None, metavar="NAME,...",
                   help="only these modules of the config (prefill, decode, page, norm, rope, silu_and_mul, sampling, "
                        "fused_moe, ...) (default: all of them)")
    g.add_argument("--cuda-include", action="append", default=[], metavar="DIR",
                   help="a directory with cublasLt.h / curand_kernel.h when the CUDA toolkit lacks them (repeatable)")
    g.add_argument("--force", action="store_true", help="rebuild modules that are already cached")
    g.add_argument("--adopt-existing", action="store_true",
                   help="take a module's .so already in --out (built by plain FlashInfer, without a manifest) as "
                        "cached, instead of letting ninja decide; its build flags may differ from this run's")
    g.add_argument("--export", metavar="DIR",
                   help="also copy just the manifest and the .so files to DIR: a small kernel cache to ship to the "
                        "GPU machine (the build tree keeps object files and sources too) (default: no export)")
    g.add_argument("--dry-run", action="store_true", help="list the modules and their cache status; build nothing")
    g.add_argument("--timeout", type=float, default=None, metavar="S", help="give up after this many seconds (default: no limit)")
    g.add_argument("--no-triton", action="store_true", help="build the FlashInfer modules only, not the Triton kernels")
    g.add_argument("--target-python", metavar="X.Y", default=None,
                   help="the Python version of the GPU machine (Triton's cache keys depend on it; default: this one)")
    g.add_argument("--device-name", metavar="NAME", default=None,
                   help="the GPU whose tuned MoE tables the Triton kernels use (default for 9.0a: NVIDIA_H200)")


def resolve_arch(arg: str | None, cfg_arch: str | None) -> Arch:
    """``--arch``, else the config's gpu_arch, else this machine's GPU; without any of them, a clear error."""
    if arg:
        return parse_arch(arg)
    if cfg_arch:
        return parse_arch(cfg_arch)
    from moeserve.hardware import probe
    gpu = probe().gpu
    if gpu is None:
        raise ValueError("precompile: this machine has no GPU to take the architecture from; give --arch, "
                         "e.g. --arch 9.0a for H100/H200, 8.0 for A100, 8.9 for L40S/L4")
    return parse_arch(gpu.arch)


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def package_version(name: str) -> str | None:
    from moeserve.hardware import package_version as version
    return version(name)


def new_manifest(arch: Arch, version: str, git: str | None, toolchain: dict, old: dict | None) -> dict:
    m = {"format": MANIFEST_FORMAT, "flashinfer_version": version, "flashinfer_git": git, "arch": arch.name,
         "arch_dir": arch.dir_name, "capability": list(arch.capability),
         "nvcc_version": toolchain.get("nvcc_version"), "tvm_ffi_version": package_version("apache-tvm-ffi"),
         "toolchain": toolchain,
         "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "configs": [], "modules": []}
    if old:
        m["modules"] = list(old.get("modules", []))
        m["configs"] = list(old.get("configs", []))
        m["first_created"] = old.get("first_created", old.get("created"))
    return m


def _merge_entry(manifest: dict, entry: dict) -> None:
    manifest["modules"] = [m for m in manifest["modules"] if m["name"] != entry["name"]] + [entry]


def export_cache(src: Path, dest: Path) -> Path:
    """Copy ``src``'s manifest and the ``.so`` of each module it lists to ``dest``, at the same relative paths.

    The result is a complete kernel cache for ``use_kernel_cache``, without build trees; modules already in
    ``dest`` for the same FlashInfer version and architecture are kept (the manifests are merged).
    """
    manifest = read_manifest(src)
    if manifest is None:
        raise KernelCacheError(f"{src} has no manifest.json to export")
    arch = parse_arch(manifest["arch"])
    existing = check_existing(dest, arch, manifest["flashinfer_version"], manifest.get("flashinfer_git"), "--export")
    merged = dict(manifest, exported_from=str(src), modules=list((existing or {}).get("modules", [])))
    for m in manifest["modules"]:
        target = dest / m["so"]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / m["so"], target)
        _merge_entry(merged, m)
    write_manifest(dest, merged)
    return dest


def check_existing(out: Path, arch: Arch, version: str, git: str | None, flag: str = "--out") -> dict | None:
    """The manifest already in ``out``, refusing one made for another FlashInfer or architecture."""
    old = read_manifest(out)
    if old is None:
        return None
    if old["flashinfer_version"] != version or (old.get("flashinfer_git") and git and old["flashinfer_git"] != git):
        raise KernelCacheError(f"{flag} {out} holds a kernel cache for flashinfer {old['flashinfer_version']}, not "
                               f"{version}; use another --out (or delete it)")
    if parse_arch(old["arch"]) != arch:
        raise KernelCacheError(f"{flag} {out} holds a kernel cache for {old['arch']}, not {arch.name}; "
                               "use one directory per architecture")
    return old


def run(args) -> int:
    """``moeserve precompile``. A ``--dry-run`` leaves nothing behind where its ``--out`` directory did not exist
    before (FlashInfer writes the sources it would compile into the workspace while it plans)."""
    out = Path(args.out).expanduser().resolve()
    fresh = args.dry_run and not out.exists()
    try:
        return _run(args)
    finally:
        if fresh:
            shutil.rmtree(out, ignore_errors=True)


def _run(args) -> int:
    from rich.console import Console
    from rich.table import Table
    from moeserve.args import config_from_args
    from moeserve.tools.modules import modules_for_config, select_modules

    con = Console(stderr=False)
    cfg = config_from_args(args)
    arch = resolve_arch(args.arch, cfg.gpu_arch)
    version = flashinfer_version()
    if version is None:
        raise ValueError("precompile: flashinfer-python is not installed (pip install flashinfer-python)")
    modules = select_modules(modules_for_config(cfg, arch), args.modules)
    out = Path(args.out).expanduser().resolve()
    if not modules:
        con.print(f"{cfg.model} on {arch.name} loads no FlashInfer JIT modules (no operator uses a flashinfer backend)")
        return run_triton(args, cfg, arch, out, con)
    out.mkdir(parents=True, exist_ok=True)
    git = flashinfer_git_version()
    try:
        old = check_existing(out, arch, version, git)
        tc = prepare_toolchain(out / SUPPORT_DIR, args.cuda_include)
    except (KernelCacheError, ToolchainError) as e:
        if not (args.dry_run and isinstance(e, ToolchainError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"warning: {e} (listing only)", file=sys.stderr)
        tc = None
    jobs = args.jobs or os.cpu_count() or 1
    parallel = args.parallel or max(1, min(len(modules), jobs // 2))
    env = dict(os.environ)
    env.update(tc.env() if tc else {})
    env.update({"FLASHINFER_WORKSPACE_BASE": str(out), "FLASHINFER_CUDA_ARCH_LIST": arch.name,
                "FLASHINFER_USE_CUDA_NORM": "1", "FLASHINFER_NVCC_THREADS": env.get("FLASHINFER_NVCC_THREADS", "1")})
    for var in ("FLASHINFER_DISABLE_JIT", "FLASHINFER_JIT_VERBOSE", "FLASHINFER_JIT_DEBUG"):
        env.pop(var, None)
    manifest = new_manifest(arch, version, git, tc.describe() if tc else {}, old)
    cfg_note = {"model": cfg.model, "dtype": cfg.dtype, "backends": cfg.backends.model_dump(),
                "modules": [m.key for m in modules]}
    if cfg_note not in manifest["configs"]:
        manifest["configs"].append(cfg_note)
    request = {"base": str(out), "modules": [m.to_json() for m in modules], "jobs": jobs, "parallel": parallel,
               "dry_run": args.dry_run, "force": args.force, "adopt": args.adopt_existing,
               "manifest_modules": {m["name"]: m for m in (old or {}).get("modules", [])}}
    con.print(f"FlashInfer {version} modules for [bold]{cfg.model}[/bold] on {arch.name} -> "
              f"{workspace_dir(out, version, arch)}")
    if tc is not None:
        con.print(f"nvcc {tc.nvcc_version} ({tc.cuda_home}); {jobs} compile jobs, up to {parallel} modules at once"
                  + (f"; headers from {', '.join(map(str, tc.include_dirs))}" if tc.include_dirs else "")
                  + (f"; libcuda stub {tc.libcuda_stub}" if tc.libcuda_stub else ""))
    by_key = {m.key: m for m in modules}
    rows: dict[str, dict] = {}
    log_dir = out / SUPPORT_DIR / "logs"
    t_start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "moeserve.tools.build_worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)

    def stop_builds():
        """Stop the worker and its builds. ninja runs each compiler in a process group of its own and stops
        them when it gets SIGTERM, so the worker's group gets SIGTERM first and SIGKILL only if it lingers."""
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            try:
                proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue
    proc.stdin.write(json.dumps(request))
    proc.stdin.close()
    other_output: list[str] = []
    timer, timed_out = None, threading.Event()
    if args.timeout:
        def give_up():
            timed_out.set()
            stop_builds()
        timer = threading.Timer(args.timeout, give_up)
        timer.start()
    try:
        for line in proc.stdout:
            if not line.startswith("@@moeserve "):
                other_output.append(line.rstrip())
                continue
            ev = json.loads(line[len("@@moeserve "):])
            m = by_key[ev["key"]]
            if ev["event"] == "planned":
                rows[m.key] = {"key": m.key, "label": m.label, "name": ev["name"], "status": ev["status"],
                               "seconds": None, "bytes": None, "error": ev.get("error")}
            elif ev["event"] == "started":
                con.print(f"  building {m.key} ({ev['name']}) with {ev['jobs']} job(s)...")
            elif ev["event"] == "done":
                row = rows.setdefault(m.key, {"key": m.key, "label": m.label})
                row.update(name=ev["name"], status={"cached": "already cached"}.get(ev["status"], ev["status"]),
                           seconds=ev["seconds"], bytes=ev["bytes"], error=ev.get("error"))
                if ev["status"] == "failed" and ev.get("log"):
                    log_dir.mkdir(parents=True, exist_ok=True)
                    (log_dir / f"{m.key}.log").write_text(ev["log"])
                if ev["status"] in ("built", "cached") and ev["so"]:
                    _merge_entry(manifest, {
                        "key": m.key, "label": m.label, "op": m.op, "backend": m.backend, "name": ev["name"],
                        "so": os.path.relpath(ev["so"], out), "seconds": ev["seconds"], "bytes": ev["bytes"],
                        "sha256": ev["sha256"]})
                    if not args.dry_run:
                        write_manifest(out, manifest)
                if ev["status"] != "cached":
                    con.print(f"  {row['status']} {m.key} in {ev['seconds']:.1f} s"
                              + (f": {ev['error']}" if ev.get("error") else ""))
    except BaseException:
        stop_builds()
        raise
    finally:
        rc = proc.wait()
        if timer is not None:
            timer.cancel()
    if timed_out.is_set():
        for r in rows.values():
            if r["status"] in ("missing", "stale"):
                r["status"] = "timed out"
    wall = time.perf_counter() - t_start
    if timed_out.is_set():
        print(f"error: precompile gave up after {args.timeout:.0f} s (--timeout)", file=sys.stderr)
    if rc != 0:
        print("\n".join(other_output[-40:]), file=sys.stderr)
        print(f"error: the build worker exited with status {rc}", file=sys.stderr)
    table = Table(title=f"FlashInfer {version} kernel cache for {arch.name}: {out}")
    for col in ("module", "what", "compile s", "size", "status"):
        table.add_column(col)
    for m in modules:
        r = rows.get(m.key, {"status": "not run"})
        status = r["status"]
        if args.dry_run and status in ("missing", "stale"):
            status = f"would build ({status})"
        if r.get("error"):
            status += f": {r['error']}"
        secs = f"{r['seconds']:.1f}" if r.get("seconds") is not None and status != "already cached" else "-"
        table.add_row(m.key, m.label, secs, _fmt_bytes(r.get("bytes")), status)
    con.print(table)
    built = [r for r in rows.values() if r["status"] == "built"]
    if built:
        con.print(f"built {len(built)} module(s) in {wall:.0f} s "
                  f"({sum(r['seconds'] or 0 for r in built):.0f} s of module build time)")
    if not args.dry_run and manifest["modules"]:
        write_manifest(out, manifest)
        con.print(f"manifest: {out / 'manifest.json'}; use it with `kernel_cache_dir: {out}` (or "
                  f"--set kernel_cache_dir={out})")
    if args.export and not args.dry_run and manifest["modules"]:
        dest = export_cache(out, Path(args.export).expanduser().resolve())
        con.print(f"exported {len(manifest['modules'])} modules to {dest} "
                  f"({_fmt_bytes(sum(m['bytes'] or 0 for m in manifest['modules']))})")
    failed = [k for k, r in rows.items() if r["status"] in ("failed", "not run", "timed out")] + \
             [m.key for m in modules if m.key not in rows]
    if failed:
        con.print(f"[red]not built: {', '.join(failed)}[/red]" + (f" (logs in {log_dir})" if log_dir.is_dir() else ""))
    triton_rc = run_triton(args, cfg, arch, out, con)
    return 1 if failed or rc != 0 or triton_rc else 0


def run_triton(args, cfg, arch: Arch, out: Path, con) -> int:
    """The Triton kernels of ``cfg``: listed (``--dry-run``) or compiled into ``out/triton`` (and exported)."""
    if args.no_triton:
        return 0
    from rich.table import Table

    from moeserve.kernel_cache.triton_cache import TRITON_DIR
    from moeserve.tools import triton_aot
    from moeserve.tools.modules import plan_for_arch
    plan = plan_for_arch(cfg, arch)
    device_name = args.device_name or triton_aot.DEFAULT_DEVICE_NAMES.get(arch.capability)
    if device_name is None:
        print(f"error: --device-name is needed for {arch.name} (the GPU whose tuned MoE tables to use, e.g. "
              "NVIDIA_H100_80GB_HBM3)", file=sys.stderr)
        return 2
    if args.dry_run:
        import tempfile
        with tempfile.TemporaryDirectory() as scratch:
            kernels = triton_aot.list_kernels(plan, arch.capability, device_name, Path(scratch))
        table = Table(title=f"Triton kernels for {cfg.model} on {arch.name} ({device_name}), steps of 1 to "
                            f"{plan.max_step_tokens} tokens")
        for col in ("kernel", "constants", "warps", "stages"):
            table.add_column(col)
        for k in kernels:
            table.add_row(k["name"], " ".join(f"{n}={v}" for n, v in k["constants"].items()),
                          str(k["num_warps"]), str(k["num_stages"] if k["num_stages"] is not None else "-"))
        con.print(table)
        return 0
    try:
        triton_aot.build(plan, out, arch.capability, device_name, args.target_python, log=con.print)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.export and (out / TRITON_DIR).is_dir():
        import shutil
        dest = Path(args.export).expanduser().resolve() / TRITON_DIR
        shutil.copytree(out / TRITON_DIR, dest, dirs_exist_ok=True)
        con.print(f"exported the Triton kernels to {dest} ({_fmt_bytes(triton_aot.size_bytes(dest))})")
    return 0
