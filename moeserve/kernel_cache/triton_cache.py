"""Triton kernels from the kernel cache: the runtime side.

``moeserve precompile`` compiles, on a machine without a GPU, every Triton kernel the configuration will
launch into ``<kernel cache>/triton`` (a Triton cache directory) and lists them in its ``manifest.json``
(``moeserve.tools.triton_aot``). At start the engine points Triton at that directory (``use_triton_cache``):

- Triton's group files name their files by absolute path, so a cache shipped to another path is rewritten
  to its own path first (in place when the directory is writable, else in a writable copy).
- Every kernel compile is counted (``knobs.compilation.listener``: a compile with ``cache_hit=False``) and
  reported beside FlashInfer's modules in the start-up log.
- With ``allow_jit: false`` a kernel missing from the cache is refused by name instead of compiled, both at
  start (the manifest must cover this configuration and hold every file it lists) and at run time (a cache
  manager that raises before Triton compiles anything).
- Triton also builds a launcher per argument-type list: a small host C module, compiled with the C compiler
  against this Python at a kernel's first load (about 0.2 s each, one after the other). They are not GPU
  kernels and cannot be built without this machine's Python and driver, so the kernel cache carries their C
  sources (``launchers/``, written by ``moeserve precompile``) and the engine builds them all at once in
  background threads from the start, beside the weights' reading (``start_launcher_builds``), together with
  the driver's utility module (``cuda_utils``, from Triton's own source); the first kernel loads then find
  them in the Triton cache. A module that fails to build here is built at first use as before.

Only the standard library and ``triton`` are imported here.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger("moeserve.kernel_cache")

TRITON_DIR = "triton"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
LAUNCHERS = "launchers"  # C sources of Triton's launcher modules, beside the manifest

_events: list[dict] = []
_state: dict = {"dir": None, "installed": False}


class TritonCacheError(RuntimeError):
    """A Triton kernel the configuration needs is not in the kernel cache and compiling is not allowed."""


def triton_key_digest() -> str:
    """sha256 of this installation's ``triton_key()`` (the build part of every cache key)."""
    from triton.runtime.cache import triton_key
    return hashlib.sha256(triton_key().encode()).hexdigest()


def read_manifest(base: Path) -> dict | None:
    path = Path(base) / TRITON_DIR / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def relocate(cache_dir: Path) -> int:
    """Point every ``__grp__*.json`` of ``cache_dir`` at the files beside it; returns how many changed."""
    n = 0
    for grp in Path(cache_dir).glob("*/__grp__*.json"):
        data = json.loads(grp.read_text())
        paths = data.get("child_paths") or {}
        new = {name: str(grp.parent.resolve() / name) for name in paths}
        if new != paths:
            tmp = grp.with_suffix(".json.tmp")
            tmp.write_text(json.dumps({"child_paths": new}))
            os.replace(tmp, grp)
            n += 1
    return n


def _writable(d: Path) -> bool:
    return os.access(d, os.W_OK) and all(os.access(p, os.W_OK) for p in d.iterdir() if p.is_dir())


def _entry_complete(cache_dir: Path, e: dict) -> bool:
    d = cache_dir / e["dir"]
    return all((d / f).is_file() for f in (f"__grp__{e['name']}.json", f"{e['name']}.json", f"{e['name']}.cubin"))


def check_coverage(manifest: dict, fingerprint: dict, cache_dir: Path) -> list[str]:
    """Why the cache does not cover a configuration with ``fingerprint`` (empty: it does)."""
    problems = []
    digest = triton_key_digest()
    if manifest.get("triton_key_sha256") != digest:
        problems.append(f"its Triton kernels were built for triton {manifest.get('triton_version')} "
                        f"({manifest.get('target_python')}, key {str(manifest.get('triton_key_sha256'))[:12]}); "
                        f"this machine's triton key is {digest[:12]}")
    covered = [c for c in manifest.get("configs", []) if _covers(c, fingerprint)]
    if fingerprint.get("kernels") and not covered:
        have = "; ".join(_describe(c) for c in manifest.get("configs", [])) or "none"
        problems.append(f"it holds no Triton kernels for {_describe(fingerprint)} (it has: {have})")
    missing = [f"{e['kernel']} ({e['dir']})" for c in covered for e in c["entries"]
               if not _entry_complete(cache_dir, e)]
    if missing:
        problems.append(f"{len(missing)} listed kernel(s) are missing from {cache_dir}: {', '.join(missing[:5])}")
    return problems


def _covers(have: dict, want: dict) -> bool:
    same = all(have.get("fingerprint", {}).get(k) == v for k, v in want.items() if k != "max_tokens")
    return same and have.get("fingerprint", {}).get("max_tokens", 0) >= want.get("max_tokens", 0)


def _describe(c: dict) -> str:
    f = c.get("fingerprint", c)
    return ", ".join(f"{k}={v}" for k, v in f.items() if k != "kernels")


def use_triton_cache(base: str | Path, fingerprint: dict, allow_jit: bool = True) -> dict:
    """Point Triton at ``<base>/triton`` (relocated if needed) before any Triton kernel launches; count
    compiles; with ``allow_jit`` false, refuse a configuration the cache does not cover and any later miss."""
    from triton import knobs
    base = Path(base).expanduser().resolve()
    src = base / TRITON_DIR
    manifest = read_manifest(base)
    summary = {"dir": None, "kernels": 0, "relocated": 0, "copied": False}
    if manifest is None:
        if not allow_jit and fingerprint.get("kernels"):
            raise TritonCacheError(f"kernel_cache_dir {base} has no Triton kernels ({TRITON_DIR}/{MANIFEST}); build "
                                   "them with `moeserve precompile` or set allow_jit: true")
        install_listener(allow_jit)
        return summary
    cache = src
    if not _writable(src):  # launcher stubs are written beside the kernels, and group files may need rewriting
        cache = Path(tempfile.gettempdir()) / "moeserve-triton" / hashlib.sha256(str(src).encode()).hexdigest()[:16]
        if not cache.is_dir():
            shutil.copytree(src, cache)
        summary["copied"] = True
    summary["relocated"] = relocate(cache)
    problems = check_coverage(manifest, fingerprint, cache)
    if problems:
        msg = f"kernel_cache_dir {base}: " + "; ".join(problems)
        if not allow_jit:
            raise TritonCacheError(msg + " (allow_jit: false)")
        log.warning("%s; missing Triton kernels will compile on first use", msg)
    knobs.cache.dir = str(cache)
    _state["dir"] = str(cache)
    covering = [c for c in manifest.get("configs", []) if _covers(c, fingerprint)]
    if covering and all("tokens" in e for e in covering[0]["entries"]):
        _state["warm_sizes"] = sorted({e["tokens"] for e in covering[0]["entries"] if e["tokens"] is not None})
    install_listener(allow_jit)
    summary.update(dir=str(cache), kernels=sum(len(c["entries"]) for c in manifest.get("configs", [])),
                   launchers=start_launcher_builds(cache, manifest))
    return summary


def build_launcher(src: str, module: str = "__triton_launcher") -> None:
    """Build (or find) Triton's host module ``module`` from C source ``src`` in the current Triton cache, as
    Triton does at a kernel's first load (``__triton_launcher``) or at its driver's start (``cuda_utils``)."""
    from triton.backends.nvidia.driver import include_dirs, libraries, library_dirs
    from triton.runtime.build import compile_module_from_src
    compile_module_from_src(src=src, name=module, library_dirs=library_dirs(), include_dirs=include_dirs,
                            libraries=libraries)


def _driver_utils_source() -> str | None:
    """The C source of the CUDA driver's utility module Triton builds when its driver starts (``cuda_utils``)."""
    try:
        from triton.backends.nvidia import driver
        return (Path(driver.__file__).parent / "driver.c").read_text()
    except (ImportError, OSError):
        return None


def start_launcher_builds(cache_dir: Path, manifest: dict) -> int:
    """Build every launcher the manifest lists, and the driver's utility module, in background threads; returns
    how many were started (``wait_launchers`` waits for them)."""
    from concurrent.futures import ThreadPoolExecutor
    names = manifest.get(LAUNCHERS) or []
    sources = []
    for name in names:
        try:
            sources.append((name, (Path(cache_dir) / LAUNCHERS / name).read_text(), "__triton_launcher"))
        except OSError:
            log.warning("Triton launcher source %s is not in the kernel cache; it is built at first use", name)
    if not sources:
        return 0
    utils = _driver_utils_source()
    if utils is not None:
        sources.append(("cuda_utils", utils, "cuda_utils"))
    pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="moeserve-launcher")
    t0 = time.perf_counter()

    def build(item):
        name, src, module = item
        try:
            build_launcher(src, module)
            return name, None, time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - Triton builds it again at first use and reports there
            return name, f"{type(e).__name__}: {e}", time.perf_counter() - t0

    _state["launchers"] = [pool.submit(build, item) for item in sources]
    pool.shutdown(wait=False)
    return len(sources)


def wait_launchers() -> dict:
    """Wait for the launcher builds ``start_launcher_builds`` started; ``{"built", "failed", "seconds"}``
    (``seconds``: from their start to the last one done; None when none ran)."""
    futures = _state.pop("launchers", None)
    if not futures:
        return _state.get("launcher_report", {"built": 0, "failed": 0, "seconds": None})
    results = [f.result() for f in futures]
    failed = [(name, why) for name, why, _ in results if why]
    for name, why in failed[:3]:
        log.warning("Triton launcher %s did not build ahead of its kernel (%s); Triton builds it at first use",
                    name, why)
    report = {"built": len(results) - len(failed), "failed": len(failed),
              "seconds": round(max(t for _, _, t in results), 3)}
    _state["launcher_report"] = report
    return report


def install_listener(allow_jit: bool) -> None:
    """Count every Triton compile (and refuse misses when ``allow_jit`` is false); idempotent."""
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    if not _state["installed"]:
        prev = knobs.compilation.listener

        def listener(*, src, metadata, metadata_group, times, cache_hit):
            _events.append({"name": getattr(src, "name", "?"), "compiled": not cache_hit,
                            "seconds": round(times.total / 1e6, 3) if times is not None else None,
                            "at": time.perf_counter()})
            if not cache_hit:
                log.info("Triton: compiled %s in %.2f s (not in the kernel cache)", getattr(src, "name", "?"),
                         times.total / 1e6 if times is not None else 0.0)
            if prev is not None:
                prev(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

        knobs.compilation.listener = listener
        _state["installed"] = True
    if allow_jit:
        return

    class NoCompileCacheManager(FileCacheManager):
        def get_group(self, filename):
            grp = super().get_group(filename)
            if (grp is None or filename not in grp) and filename.endswith(".json"):
                raise TritonCacheError(f"Triton kernel {filename[:-5]} (cache entry {self.key}) is not in the kernel "
                                       f"cache {knobs.cache.dir} and allow_jit is false")
            return grp

    knobs.cache.manager_class = NoCompileCacheManager


def warm_step_sizes() -> list[int] | None:
    """The MoE step sizes whose first step launches a kernel, as the kernel cache in use lists them (None
    without one)."""
    return _state.get("warm_sizes")


def triton_events() -> list[dict]:
    return [dict(e) for e in _events]


def triton_summary() -> str:
    compiled = [e for e in _events if e["compiled"]]
    loaded = len(_events) - len(compiled)
    where = "the kernel cache" if _state["dir"] else "Triton's cache"
    text = f"Triton: {loaded} kernels from {where}, {len(compiled)} compiled"
    if compiled:
        text += " (" + ", ".join(e["name"] for e in compiled[:5]) + (", ..." if len(compiled) > 5 else "") + ")"
    report = _state.get("launcher_report")
    if report and report["built"] + report["failed"]:
        text += f"; {report['built']} host modules (launchers) built ahead in {report['seconds']:.2f} s"
        if report["failed"]:
            text += f" ({report['failed']} left to first use)"
    return text
