"""``moeserve install-kernels``: install FlashInfer's pre-built kernel packages matching this machine.

flashinfer-cubin (pre-downloaded cubins; it must equal the flashinfer-python version) and
flashinfer-jit-cache (pre-compiled JIT modules; ``<version>+cu<CUDA>``, one wheel per CUDA version
covering every architecture FlashInfer builds for, over 1 GB) come from FlashInfer's wheel index, not
PyPI. FlashInfer 0.6.14's own command line has no installer for them, so this runs pip with that index.
When the index cannot be reached, nothing is installed and ``moeserve precompile`` is the way to get the
kernels.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import urllib.error
import urllib.request

from moeserve.kernel_cache.layout import Arch, flashinfer_version, parse_arch

FLASHINFER_INDEX = "https://flashinfer.ai/whl"
PROBE_TIMEOUT_S = 5.0
PACKAGES = ("cubin", "jit-cache")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", help="GPU architecture, e.g. 9.0a; default: this machine's GPU")
    p.add_argument("--cuda", help="CUDA version of the wheels, e.g. 13.0; default: torch's CUDA, else nvcc's")
    p.add_argument("--packages", default="cubin,jit-cache", help="which of cubin, jit-cache (default both)")
    p.add_argument("--index-url", default=FLASHINFER_INDEX, help=f"FlashInfer's wheel index (default {FLASHINFER_INDEX})")
    p.add_argument("--timeout", type=float, default=PROBE_TIMEOUT_S, help="seconds to wait for the index to answer")
    p.add_argument("--dry-run", action="store_true", help="print the pip commands; install nothing")


def cuda_tag(cuda: str) -> str:
    """``13.0`` -> ``cu130``; the CUDA builds FlashInfer publishes jit-cache wheels for."""
    parts = str(cuda).strip().lower().removeprefix("cu").split(".")
    try:
        major, minor = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        raise ValueError(f"--cuda: {cuda!r} is not a CUDA version; write it like 13.0 or 12.9") from None
    if major >= 13:
        return "cu130"
    if (major, minor) in ((12, 8), (12, 9)):
        return f"cu{major}{minor}"
    raise ValueError(f"--cuda: FlashInfer publishes flashinfer-jit-cache for CUDA 12.8, 12.9 and 13.0, not {cuda}; "
                     "build the kernels with `moeserve precompile` instead")


def detect_cuda() -> str | None:
    try:
        import torch
        if torch.version.cuda:
            return torch.version.cuda
    except ImportError:
        pass
    try:
        from moeserve.tools.toolchain import ToolchainError, find_cuda_home, nvcc_version
        return nvcc_version(find_cuda_home())
    except (ToolchainError, OSError):
        return None


def detect_arch(arg: str | None) -> Arch:
    if arg:
        return parse_arch(arg)
    from moeserve.hardware import probe
    gpu = probe().gpu
    if gpu is None:
        raise ValueError("install-kernels: this machine has no GPU to take the architecture from; give --arch, e.g. 9.0a")
    return parse_arch(gpu.arch)


def install_commands(version: str, tag: str, packages: tuple[str, ...] = PACKAGES, index_url: str = FLASHINFER_INDEX,
                     python: str = sys.executable) -> list[list[str]]:
    """One pip command per package; ``--no-deps`` so pip leaves torch and flashinfer-python alone."""
    base = index_url.rstrip("/")
    cmds = []
    if "cubin" in packages:
        cmds.append([python, "-m", "pip", "install", "--no-deps", f"flashinfer-cubin=={version}",
                     "--extra-index-url", base])
    if "jit-cache" in packages:
        cmds.append([python, "-m", "pip", "install", "--no-deps", f"flashinfer-jit-cache=={version}+{tag}",
                     "--extra-index-url", f"{base}/{tag}"])
    return cmds


def probe_index(url: str, timeout: float) -> str | None:
    """None when ``url`` answers; otherwise why not."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout) as r:
            return None if r.status < 500 else f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return None if e.code < 500 else f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return str(getattr(e, "reason", e))


def unreachable_message(url: str, reason: str, arch: Arch) -> str:
    return (f"FlashInfer's package index {url} is not reachable from this machine ({reason}); nothing was installed.\n"
            f"Build the kernels this config needs instead, on any machine with nvcc (no GPU needed):\n"
            f"  moeserve precompile --config CONFIG --arch {arch.name} --out DIR\n"
            f"then start with `kernel_cache_dir: DIR` in the config (or --set kernel_cache_dir=DIR).")


def run(args) -> int:
    version = flashinfer_version()
    if version is None:
        raise ValueError("install-kernels: flashinfer-python is not installed (pip install flashinfer-python)")
    packages = tuple(p.strip() for p in args.packages.split(",") if p.strip())
    bad = [p for p in packages if p not in PACKAGES]
    if bad or not packages:
        raise ValueError(f"--packages: {', '.join(bad) or 'nothing'} given; choose from {', '.join(PACKAGES)}")
    arch = detect_arch(args.arch)
    if arch.capability < (7, 5):
        raise ValueError(f"--arch: {arch.name} is below sm75; FlashInfer has no kernels for it")
    cuda = args.cuda or detect_cuda()
    if cuda is None:
        raise ValueError("install-kernels: cannot tell the CUDA version (torch has none and nvcc is absent); "
                         "give --cuda, e.g. --cuda 13.0")
    tag = cuda_tag(cuda)
    cmds = install_commands(version, tag, packages, args.index_url)
    print(f"flashinfer {version}, {arch.name} ({arch.sm}), CUDA {cuda} -> {tag}: "
          f"{', '.join('flashinfer-' + p for p in packages)}")
    if args.dry_run:
        for c in cmds:
            print(shlex.join(c))
        return 0
    probe_url = f"{args.index_url.rstrip('/')}/{tag}/"
    reason = probe_index(probe_url, args.timeout)
    if reason is not None:
        print(unreachable_message(probe_url, reason, arch), file=sys.stderr)
        return 1
    for c in cmds:
        print("+", shlex.join(c), flush=True)
        rc = subprocess.call(c)
        if rc != 0:
            print(f"error: pip exited with status {rc}", file=sys.stderr)
            return rc
    print("installed; check with `moeserve env` (FlashInfer artifacts)")
    return 0
