"""Where FlashInfer keeps compiled modules, and the manifest that makes a directory a moeserve kernel cache.

A kernel cache is a FlashInfer workspace base directory ``DIR``: FlashInfer's own layout below it,
``DIR/.cache/flashinfer/<flashinfer version>/<arch dir, e.g. 90a>/cached_ops/<module>/<module>.so``,
plus ``DIR/manifest.json`` written by ``moeserve precompile``::

    {"format": "moeserve-kernel-cache/1", "flashinfer_version": "0.6.14", "flashinfer_git": "19f1a41e...",
     "arch": "9.0a", "arch_dir": "90a", "capability": [9, 0], "nvcc_version": "13.0", "created": "...",
     "modules": [{"key", "label", "op", "backend", "name", "so" (relative to DIR), "seconds", "bytes",
                  "sha256"}, ...]}

Nothing here imports FlashInfer: it reads FlashInfer's environment variables at import time, so code that
chooses a cache must run before ``import flashinfer``.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "moeserve-kernel-cache/1"


class KernelCacheError(RuntimeError):
    """A kernel cache that cannot be used here; the message says why and what to do."""


# --- FlashInfer's version, without importing it --------------------------------------------------

def flashinfer_version() -> str | None:
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def flashinfer_git_version() -> str | None:
    """The git commit recorded in the installed wheel's ``flashinfer/_build_meta.py``, if any."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        meta = Path(loc) / "_build_meta.py"
        if meta.is_file():
            m = re.search(r"__git_version__\s*=\s*['\"]([^'\"]+)['\"]", meta.read_text())
            if m:
                return m.group(1)
    return None


# --- architectures --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arch:
    """A CUDA target as FlashInfer names it: ``9.0a`` -> major 9, minor "0a", directory ``90a``."""

    major: int
    minor: str  # minor digit(s) plus FlashInfer's suffix: "0a", "9", "0f"

    @property
    def capability(self) -> tuple[int, int]:
        return self.major, int(re.match(r"\d+", self.minor).group())

    @property
    def name(self) -> str:
        """The ``FLASHINFER_CUDA_ARCH_LIST`` spelling, e.g. ``9.0a``."""
        return f"{self.major}.{self.minor}"

    @property
    def dir_name(self) -> str:
        """FlashInfer's workspace directory for this target alone, e.g. ``90a``."""
        return f"{self.major}{self.minor}"

    @property
    def sm(self) -> str:
        major, minor = self.capability
        return f"sm{major}{minor}"


def _flashinfer_suffix(major: int, minor: int) -> str:
    """The suffix FlashInfer's ``CompilationContext`` gives an unsuffixed capability."""
    if major == 9 or (major >= 10 and major != 12) or (major == 12 and minor != 0):
        return "a"
    if major == 12:
        return "f"
    return ""


def parse_arch(text: str) -> Arch:
    """``9.0a``, ``9.0``, ``90a``, ``sm90``, ``sm_90a`` or ``compute_90a`` -> ``Arch(9, "0a")``."""
    raw = str(text).strip().lower()
    for prefix in ("compute_", "sm_", "sm"):
        if raw.startswith(prefix):
            raw = raw[len(prefix):]
            break
    m = re.fullmatch(r"(\d+)\.(\d)([af]?)", raw) or re.fullmatch(r"(\d+)(\d)([af]?)", raw)
    if not m:
        raise ValueError(f"arch: {text!r} is not a CUDA architecture; write it like 9.0a (Hopper), 8.0 or 8.9")
    major, minor, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
    return Arch(major, f"{minor}{suffix or _flashinfer_suffix(major, minor)}")


def arch_for_capability(capability: tuple[int, int]) -> Arch:
    return parse_arch(f"{capability[0]}.{capability[1]}")


# --- paths -----------------------------------------------------------------------------------------

def workspace_dir(base: str | Path, version: str, arch: Arch) -> Path:
    return Path(base) / ".cache" / "flashinfer" / version / arch.dir_name


def jit_dir(base: str | Path, version: str, arch: Arch) -> Path:
    """FlashInfer's ``FLASHINFER_JIT_DIR`` for this base, version and target."""
    return workspace_dir(base, version, arch) / "cached_ops"


def module_so(base: str | Path, version: str, arch: Arch, name: str) -> Path:
    return jit_dir(base, version, arch) / name / f"{name}.so"


def compiled_modules(jit_directory: str | Path) -> list[str]:
    """Names of the modules that have a ``<name>/<name>.so`` in a ``cached_ops`` directory."""
    d = Path(jit_directory)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if (p / f"{p.name}.so").is_file())


def default_workspace_base() -> Path:
    return Path(os.environ.get("FLASHINFER_WORKSPACE_BASE") or Path.home())


# --- manifest --------------------------------------------------------------------------------------

def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(base: str | Path) -> dict | None:
    """The manifest of the cache at ``base``; None when there is none."""
    path = Path(base) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise KernelCacheError(f"kernel cache manifest {path} cannot be read: {e}") from e
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise KernelCacheError(f"{path} is not a moeserve kernel cache manifest (format {MANIFEST_FORMAT})")
    for key in ("flashinfer_version", "arch", "modules"):
        if key not in data:
            raise KernelCacheError(f"kernel cache manifest {path} lacks {key!r}")
    return data


def write_manifest(base: str | Path, manifest: dict) -> Path:
    """Write atomically, so a run killed half-way leaves the previous manifest intact."""
    path = Path(base) / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def check_compatible(manifest: dict, where: str, version: str | None, git: str | None,
                     capability: tuple[int, int] | None, gpu_name: str = "this GPU") -> None:
    """Raise ``KernelCacheError`` when the cache was built for another FlashInfer or another GPU."""
    built_version, built_git = manifest.get("flashinfer_version"), manifest.get("flashinfer_git")
    arch = parse_arch(manifest["arch"])
    rebuild = f"rebuild it with `moeserve precompile --arch {{arch}} --out {where}`"
    if version is None:
        raise KernelCacheError(f"kernel cache {where} was built for flashinfer {built_version}, "
                               "but flashinfer-python is not installed here")
    if built_version != version:
        raise KernelCacheError(
            f"kernel cache {where} was built for flashinfer {built_version} but flashinfer {version} is installed; "
            + rebuild.format(arch=arch.name))
    if built_git and git and built_git != git:
        raise KernelCacheError(
            f"kernel cache {where} was built for flashinfer {built_version} (git {built_git[:12]}) but the installed "
            f"flashinfer {version} is git {git[:12]}; " + rebuild.format(arch=arch.name))
    if capability is not None and arch.capability != tuple(capability):
        here = arch_for_capability(tuple(capability))
        raise KernelCacheError(
            f"kernel cache {where} was built for {arch.name} ({arch.sm}) but {gpu_name} is {here.name} ({here.sm}); "
            + rebuild.format(arch=here.name))


def cached_status(so: Path, entry: dict | None, ninja_clean: bool | None) -> str:
    """``cached``, ``missing`` or ``stale`` for one module's ``.so``.

    A manifest entry decides by size and sha256 (a cache copied to another path is still valid, though
    ninja would want to rebuild it); without one, ninja's dry run decides.
    """
    if not so.is_file():
        return "missing"
    if entry is not None and entry.get("sha256"):
        if so.stat().st_size == entry.get("bytes") and sha256_file(so) == entry["sha256"]:
            return "cached"
        return "stale"
    return "cached" if ninja_clean else "stale"
