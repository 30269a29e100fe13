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
  manager that raises before Triton compiles anything). The launcher stubs Triton builds with the host C
  compiler (one per argument-type list, about 0.3 s each, tied to the Python version) are not kernels: they
  are built during start-up and logged.

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
    summary.update(dir=str(cache), kernels=sum(len(c["entries"]) for c in manifest.get("configs", [])))
    return summary


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
    return text
