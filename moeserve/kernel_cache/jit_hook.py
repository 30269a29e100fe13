"""Watches FlashInfer load its JIT modules: names a module before it compiles, times it, and loads modules
of a moeserve kernel cache straight from their ``.so``.

``install()`` (called by ``moeserve.kernel_cache.flashinfer_env``, before any ``import flashinfer``) wraps
``flashinfer.jit.core.JitSpec.build_and_load`` as soon as that module is imported. For every module
FlashInfer loads it then records an event ``{name, compiled, seconds, source}`` (see ``jit_events()``),
where ``source`` is one of:

- ``kernel cache``: listed in the active kernel cache's manifest and loaded from it, without ninja. A cache
  built at another path or on another machine must be loaded this way: ninja's build log holds absolute
  paths and flags, so ninja would rebuild every module of a relocated cache;
- ``flashinfer-jit-cache``: FlashInfer's own AOT package had it;
- ``jit cache``: already compiled in FlashInfer's JIT directory (ninja had nothing to do);
- ``compiled``: compiled now. ``FlashInfer: compiling <name> (not in the kernel cache)...`` is logged
  before, ``FlashInfer: compiled <name> in X s`` after;
- ``failed``: building or loading raised.

Only the standard library is imported here.
"""
from __future__ import annotations

import importlib.abc
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("moeserve.kernel_cache")

TARGET_MODULE = "flashinfer.jit.core"

_events: list[dict] = []
_lock = threading.Lock()
_cache: dict | None = None  # {"root": Path, "modules": {name: entry}, "verified": {name: Path | None}}
_installed = False
_allow_jit = True


def set_allow_jit(allow: bool) -> None:
    """With ``False``, a FlashInfer module that is not in the kernel cache is refused by name, not compiled."""
    global _allow_jit
    _allow_jit = allow


# --- events ----------------------------------------------------------------------------------------

def jit_events() -> list[dict]:
    """Every FlashInfer module load seen in this process, in order."""
    with _lock:
        return [dict(e) for e in _events]


def clear_jit_events() -> None:
    with _lock:
        _events.clear()


def record(name: str, compiled: bool, seconds: float, source: str) -> None:
    with _lock:
        _events.append({"name": name, "compiled": compiled, "seconds": round(seconds, 3), "source": source})


_SOURCE_WORDS = {"kernel cache": "the kernel cache", "jit cache": "FlashInfer's JIT cache",
                 "flashinfer-jit-cache": "flashinfer-jit-cache"}


def startup_summary() -> str:
    """One line for the engine's ready log, e.g. ``FlashInfer: 9 modules loaded from the kernel cache, 0 compiled``."""
    by_name: dict[str, dict] = {}
    for e in jit_events():
        by_name.setdefault(e["name"], e)
    if not by_name:
        return "FlashInfer: no JIT modules loaded yet"
    events = list(by_name.values())
    failed = [e for e in events if e["source"] == "failed"]
    compiled = [e for e in events if e["compiled"] and e["source"] != "failed"]
    loaded = [e for e in events if not e["compiled"] and e["source"] != "failed"]
    sources: dict[str, int] = {}
    for e in loaded:
        sources[e["source"]] = sources.get(e["source"], 0) + 1
    plural = "module" if len(loaded) == 1 else "modules"
    if set(sources) == {"kernel cache"}:
        text = f"FlashInfer: {len(loaded)} {plural} loaded from the kernel cache"
    else:
        parts = ", ".join(f"{n} from {_SOURCE_WORDS.get(src, src)}" for src, n in sorted(sources.items()))
        text = f"FlashInfer: {len(loaded)} {plural} loaded" + (f" ({parts})" if parts else "")
    text += f", {len(compiled)} compiled"
    if compiled:
        total = sum(e["seconds"] for e in compiled)
        text += f" in {total:.1f} s ({', '.join(e['name'] for e in compiled)})"
    if failed:
        text += f", {len(failed)} failed ({', '.join(e['name'] for e in failed)})"
    return text


# --- the kernel cache FlashInfer loads from ---------------------------------------------------------

def set_kernel_cache(root: str | Path, manifest: dict) -> None:
    """Load the manifest's modules from ``root`` from now on (``moeserve.kernel_cache.use_kernel_cache`` calls this)."""
    global _cache
    modules = {m["name"]: m for m in manifest.get("modules", []) if m.get("name") and m.get("so")}
    with _lock:
        _cache = {"root": Path(root), "modules": modules, "verified": {}}


def clear_kernel_cache() -> None:
    global _cache
    with _lock:
        _cache = None


def active_kernel_cache() -> dict | None:
    with _lock:
        if _cache is None:
            return None
        return {"root": str(_cache["root"]), "modules": sorted(_cache["modules"])}


def cache_lookup(name: str) -> Path | None:
    """The verified ``.so`` for ``name`` in the active kernel cache; None when it has no (valid) copy."""
    from moeserve.kernel_cache.layout import sha256_file

    with _lock:
        cache = _cache
        if cache is None or name not in cache["modules"]:
            return None
        if name in cache["verified"]:
            return cache["verified"][name]
    entry = cache["modules"][name]
    path = cache["root"] / entry["so"]
    good: Path | None = path
    if not path.is_file():
        log.warning("kernel cache %s: %s is listed but %s is missing", cache["root"], name, path)
        good = None
    elif entry.get("bytes") is not None and path.stat().st_size != entry["bytes"]:
        log.warning("kernel cache %s: %s has %d bytes, the manifest says %d; not using it",
                    cache["root"], path.name, path.stat().st_size, entry["bytes"])
        good = None
    elif entry.get("sha256") and sha256_file(path) != entry["sha256"]:
        log.warning("kernel cache %s: %s does not match its sha256 in the manifest; not using it",
                    cache["root"], path.name)
        good = None
    with _lock:
        cache["verified"][name] = good
    return good


# --- would this module compile? ---------------------------------------------------------------------

def ninja_is_clean(spec) -> bool | None:
    """Whether ninja has nothing to do for ``spec``; None when that cannot be told.

    A dry run (``ninja -n``) of the build file FlashInfer would write now, kept in a temporary file so that
    the module's own ``build.ninja`` and ninja's logs are left as they are.
    """
    import tempfile
    try:
        from flashinfer.jit.cpp_ext import generate_ninja_build_for_op
        content = generate_ninja_build_for_op(
            name=spec.name, sources=spec.sources, extra_cflags=spec.extra_cflags,
            extra_cuda_cflags=spec.extra_cuda_cflags, extra_ldflags=spec.extra_ldflags,
            extra_include_dirs=spec.extra_include_dirs, needs_device_linking=spec.needs_device_linking)
        with tempfile.NamedTemporaryFile("w", suffix=".ninja", delete=False) as f:
            f.write(content)
        try:
            out = subprocess.run(["ninja", "-n", "-C", str(spec.build_dir), "-f", f.name],
                                 capture_output=True, text=True, timeout=60)
        finally:
            os.unlink(f.name)
    except Exception:  # noqa: BLE001 - no FlashInfer, ninja or nvcc, unreadable dir: unknown
        return None
    if out.returncode != 0:
        return None
    return "no work to do" in out.stdout


def needs_build(spec) -> bool:
    """True when ``build_and_load`` is going to run the compiler for ``spec``."""
    so = Path(spec.jit_library_path)
    if not so.is_file():
        return True
    clean = ninja_is_clean(spec)
    if clean is not None:
        return not clean
    newest_source = max((Path(s).stat().st_mtime for s in spec.sources if Path(s).exists()), default=0.0)
    return so.stat().st_mtime < newest_source


# --- the wrapper -----------------------------------------------------------------------------------

def wrap_build_and_load(original):
    """``JitSpec.build_and_load`` that loads from the kernel cache when it can and logs any compile."""

    def build_and_load(self):
        name = self.name
        cached = cache_lookup(name)
        t0 = time.perf_counter()
        if cached is not None:
            try:
                module = self.load(cached)
            except Exception:
                record(name, False, time.perf_counter() - t0, "failed")
                raise
            record(name, False, time.perf_counter() - t0, "kernel cache")
            return module
        if self.is_aot:
            module = original(self)
            record(name, False, time.perf_counter() - t0, "flashinfer-jit-cache")
            return module
        compiling = needs_build(self)
        if compiling and not _allow_jit:
            from moeserve.kernel_cache.layout import KernelCacheError
            record(name, False, 0.0, "refused")
            raise KernelCacheError(f"FlashInfer module {name} is not in the kernel cache and allow_jit is false")
        if compiling and os.environ.get("FLASHINFER_DISABLE_JIT"):
            log.error("FlashInfer: %s is not in the kernel cache and FLASHINFER_DISABLE_JIT is set: not compiling it",
                      name)
            compiling = False
        elif compiling:
            log.warning("FlashInfer: compiling %s (not in the kernel cache)...", name)
        t0 = time.perf_counter()
        try:
            module = original(self)
        except BaseException:
            record(name, compiling, time.perf_counter() - t0, "failed")
            raise
        seconds = time.perf_counter() - t0
        if compiling:
            log.warning("FlashInfer: compiled %s in %.1f s", name, seconds)
        record(name, compiling, seconds, "compiled" if compiling else "jit cache")
        return module

    build_and_load.__wrapped__ = original
    build_and_load.moeserve_wrapper = True
    return build_and_load


def patch_jit_core(core_module) -> None:
    """Wrap ``JitSpec.build_and_load`` in FlashInfer's (just imported) JIT core, once."""
    spec_cls = core_module.JitSpec
    if getattr(spec_cls.build_and_load, "moeserve_wrapper", False):
        return
    spec_cls.build_and_load = wrap_build_and_load(spec_cls.build_and_load)
    _adopt_workspace_cache(sys.modules.get("flashinfer.jit.env"))


def _adopt_workspace_cache(env_module) -> None:
    """Use a kernel cache found at FlashInfer's workspace base when none was chosen explicitly."""
    if env_module is None or active_kernel_cache() is not None:
        return
    from moeserve.kernel_cache.layout import (KernelCacheError, check_compatible, flashinfer_git_version,
                                         flashinfer_version, parse_arch, read_manifest)
    base = Path(env_module.FLASHINFER_BASE_DIR)
    try:
        manifest = read_manifest(base)
        if manifest is None:
            return
        check_compatible(manifest, str(base), flashinfer_version(), flashinfer_git_version(), None)
        if parse_arch(manifest["arch"]).dir_name != Path(env_module.FLASHINFER_WORKSPACE_DIR).name:
            raise KernelCacheError(f"kernel cache {base} was built for {manifest['arch']}, but FlashInfer targets "
                                   f"{Path(env_module.FLASHINFER_WORKSPACE_DIR).name}")
    except KernelCacheError as e:
        log.warning("%s; FlashInfer will compile what it needs", e)
        return
    set_kernel_cache(base, manifest)
    log.info("kernel cache %s: %d FlashInfer modules (found at FLASHINFER_WORKSPACE_BASE)", base,
             len(manifest["modules"]))


# --- the import hook -------------------------------------------------------------------------------

class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then patches the module it loaded."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        patch_jit_core(module)

    def __getattr__(self, item):
        return getattr(self._inner, item)


class _JitCoreFinder(importlib.abc.MetaPathFinder):
    """Finds ``flashinfer.jit.core`` with the other finders and hands it a patching loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Hook FlashInfer's JIT core now, or when it is first imported. Safe to call any number of times."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    core = sys.modules.get(TARGET_MODULE)
    if core is not None:
        patch_jit_core(core)
    else:
        sys.meta_path.insert(0, _JitCoreFinder())
