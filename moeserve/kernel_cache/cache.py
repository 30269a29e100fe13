"""Using a kernel cache made by ``moeserve precompile``, and reporting FlashInfer's installed artifacts."""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from moeserve.kernel_cache import jit_hook
from moeserve.kernel_cache.layout import (KernelCacheError, arch_for_capability, check_compatible, compiled_modules,
                                     default_workspace_base, flashinfer_git_version, flashinfer_version, parse_arch,
                                     read_manifest)

log = logging.getLogger("moeserve.kernel_cache")


def use_kernel_cache(path: str | Path, hw) -> dict:
    """Point FlashInfer at the kernel cache in ``path``; call before anything imports flashinfer.

    Checks the manifest against the installed FlashInfer (version and git commit) and ``hw``'s first GPU
    (architecture) and raises ``KernelCacheError`` naming both sides when they differ. Then sets
    ``FLASHINFER_WORKSPACE_BASE`` and ``FLASHINFER_CUDA_ARCH_LIST`` and has moeserve's JIT hook load the
    manifest's modules from the cache (installing the hook, so that any later ``import flashinfer`` in the
    process goes through it). Returns a summary for the start-up log.
    """
    base = Path(path).expanduser().resolve()
    where = f"kernel_cache_dir {base}"
    manifest = read_manifest(base)
    if manifest is None:
        raise KernelCacheError(f"{where} has no manifest.json; build it with "
                               f"`moeserve precompile --arch ARCH --out {base}`")
    gpu = hw.gpu if hw is not None else None
    check_compatible(manifest, where, flashinfer_version(), flashinfer_git_version(),
                     gpu.capability if gpu is not None else None, gpu.name if gpu is not None else "this GPU")
    arch = parse_arch(manifest["arch"])
    env_module = sys.modules.get("flashinfer.jit.env")
    if env_module is not None:
        current = Path(env_module.FLASHINFER_BASE_DIR).expanduser().resolve()
        if current != base:
            raise KernelCacheError(
                f"{where}: flashinfer was already imported in this process with workspace {current}; set "
                "kernel_cache_dir (or FLASHINFER_WORKSPACE_BASE) before anything imports flashinfer")
    previous = os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
    if previous and previous.split() != [arch.name]:
        log.warning("FLASHINFER_CUDA_ARCH_LIST=%r replaced by %r, the kernel cache's architecture", previous, arch.name)
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(base)
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = arch.name
    jit_hook.set_kernel_cache(base, manifest)
    # FlashInfer's own loader, imported without the hook, runs ninja in the workspace for every module, and the
    # cache holds no build files: it would compile each module again over the cache's .so (then unusable).
    jit_hook.install()
    modules = manifest.get("modules", [])
    missing = [m["name"] for m in modules if not (base / m["so"]).is_file()]
    summary = {"path": str(base), "flashinfer_version": manifest["flashinfer_version"], "arch": arch.name,
               "nvcc_version": manifest.get("nvcc_version"), "created": manifest.get("created"),
               "modules": len(modules), "missing": missing,
               "gpu_checked": gpu is not None}
    notes = [n for n in (_cuda_mismatch(manifest.get("nvcc_version")), _tvm_ffi_mismatch(manifest.get("tvm_ffi_version")))
             if n]
    if notes:
        summary["warnings"] = notes
        for note in notes:
            log.warning("%s: %s", where, note)
    log.info("kernel cache %s: %d FlashInfer modules for flashinfer %s on %s%s", base, len(modules),
             manifest["flashinfer_version"], arch.name, f"; {len(missing)} missing" if missing else "")
    return summary


def _cuda_mismatch(nvcc_version: str | None) -> str | None:
    """A note when the cache's CUDA major differs from the CUDA torch runs with (its modules may not load)."""
    try:
        import torch
        runtime = torch.version.cuda
    except ImportError:
        return None
    if not nvcc_version or not runtime or nvcc_version.split(".")[0] == runtime.split(".")[0]:
        return None
    return f"its modules were compiled with CUDA {nvcc_version} but torch runs CUDA {runtime}"


def _tvm_ffi_mismatch(built: str | None) -> str | None:
    """FlashInfer's modules are built against tvm-ffi's headers; another tvm-ffi may not load them."""
    from moeserve.hardware import package_version
    here = package_version("apache-tvm-ffi")
    if not built or not here or built == here:
        return None
    return f"its modules were built against apache-tvm-ffi {built} but {here} is installed"


# --- `moeserve env` --------------------------------------------------------------------------------

def _jit_cache_package() -> dict:
    """What the installed flashinfer-jit-cache holds, read from its files (it is not imported)."""
    spec = importlib.util.find_spec("flashinfer_jit_cache")
    if spec is None or not spec.submodule_search_locations:
        return {}
    root = Path(list(spec.submodule_search_locations)[0]) / "jit_cache"
    names = compiled_modules(root)
    return {"dir": str(root), "modules": names}


def _target_arch(hw):
    env_arch = os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
    if env_arch:
        archs = [parse_arch(a) for a in env_arch.split()]
        return archs[0] if len(archs) == 1 else None, "_".join(sorted(a.dir_name for a in archs))
    if hw is not None and hw.gpu is not None:
        arch = arch_for_capability(hw.gpu.capability)
        return arch, arch.dir_name
    return None, None


def artifact_report(hw) -> dict:
    """FlashInfer's packages, whether they match each other and the GPU, and where compiled modules live."""
    from moeserve.hardware import package_version
    py = flashinfer_version()
    cubin = package_version("flashinfer-cubin")
    jc = package_version("flashinfer-jit-cache")
    rep: dict = {"flashinfer-python": py or "not installed", "flashinfer-cubin": cubin or "not installed",
                 "flashinfer-jit-cache": jc or "not installed"}
    if py and cubin:
        rep["cubin matches python"] = "yes" if cubin == py else f"NO: cubin {cubin} != python {py} (FlashInfer refuses it)"
    if py and jc:
        rep["jit-cache matches python"] = ("yes" if jc.startswith(py) else
                                           f"NO: jit-cache {jc} does not start with {py} (FlashInfer refuses it)")
        local = jc.split("+", 1)[1] if "+" in jc else None
        rep["jit-cache build"] = local or "no local version suffix"
        try:
            import torch
            runtime = torch.version.cuda
        except ImportError:
            runtime = None
        if local and local.startswith("cu") and runtime:
            want = "cu" + "".join(runtime.split(".")[:2])
            rep["jit-cache CUDA matches torch"] = "yes" if local == want else f"NO: {local} vs torch CUDA {runtime}"
        pkg = _jit_cache_package()
        if pkg:
            rep["aot dir"] = pkg["dir"]
            rep["aot modules"] = len(pkg["modules"])
            arch, _ = _target_arch(hw)
            if arch is not None:
                tag = f"_{arch.capability[0]}{arch.capability[1]}"
                specific = [n for n in pkg["modules"] if n.endswith(tag) or f"sm{arch.capability[0]}{arch.capability[1]}" in n]
                rep["aot covers GPU"] = (f"{len(specific)} {arch.sm}-specific modules (e.g. {specific[0]})" if specific
                                         else f"no {arch.sm}-specific modules found")
    else:
        rep["aot dir"] = "none (flashinfer-jit-cache not installed)"
    base = default_workspace_base()
    arch, dir_name = _target_arch(hw)
    if py and dir_name:
        d = base / ".cache" / "flashinfer" / py / dir_name / "cached_ops"
        rep["jit cache dir"] = str(d)
        rep["jit cache modules"] = len(compiled_modules(d))
    elif py:
        rep["jit cache dir"] = f"{base / '.cache' / 'flashinfer' / py}/<arch> (no GPU; set FLASHINFER_CUDA_ARCH_LIST)"
    try:
        manifest = read_manifest(base)
    except KernelCacheError as e:
        rep["kernel cache"] = str(e)
    else:
        if manifest is not None:
            rep["kernel cache"] = (f"{base}: {len(manifest['modules'])} modules for flashinfer "
                                   f"{manifest['flashinfer_version']} on {manifest['arch']}")
    active = jit_hook.active_kernel_cache()
    if active:
        rep["kernel cache in use"] = f"{active['root']} ({len(active['modules'])} modules)"
    if jit_hook.jit_events():
        rep["this process"] = jit_hook.startup_summary()
    return rep

