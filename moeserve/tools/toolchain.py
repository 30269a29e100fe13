"""The CUDA toolchain ``moeserve precompile`` compiles FlashInfer's modules with, on a machine without a GPU.

FlashInfer's JIT needs nvcc, the cuBLAS, cuRAND and NVRTC headers (``cublasLt.h`` is included even by the
norm kernels; ``curand_kernel.h`` by sampling; ``nvrtc.h`` by the TensorRT-LLM FP8 GEMM and MoE modules),
and ``libcuda.so`` / ``libnvrtc.so`` to link against (``-lcuda``, ``-lnvrtc``). A bare CUDA toolkit may lack
them: the headers can come from the ``nvidia-cublas`` / ``nvidia-curand`` / ``nvidia-cuda-nvrtc`` wheels,
and a stand-in library with the real one's soname and function names is enough to link, since the GPU
machine's driver and NVRTC resolve the symbols when the module is loaded there.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

REQUIRED_HEADERS = {"cublasLt.h": "nvidia-cublas", "curand_kernel.h": "nvidia-curand", "nvrtc.h": "nvidia-cuda-nvrtc"}


def header_packages(headers: list[str], cuda_major: str) -> str:
    """pip names of the wheels holding ``headers``: ``nvidia-cublas`` for CUDA 13, ``nvidia-cublas-cu12`` before."""
    suffix = "" if int(cuda_major) >= 13 else f"-cu{cuda_major}"
    return " ".join(sorted({REQUIRED_HEADERS[h] + suffix for h in headers}))


class ToolchainError(RuntimeError):
    """Something precompile needs is missing; the message says what to install or pass."""


@dataclass
class Toolchain:
    cuda_home: Path
    nvcc_version: str
    include_dirs: list[Path] = field(default_factory=list)  # added for headers the toolkit lacks
    link_dirs: list[Path] = field(default_factory=list)  # added for libcuda.so
    libcuda_stub: Path | None = None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment variables FlashInfer's JIT reads, on top of ``base``."""
        base = dict(os.environ if base is None else base)
        env = {"CUDA_HOME": str(self.cuda_home)}
        inc = " ".join(f"-isystem {shlex.quote(str(d))}" for d in self.include_dirs)
        if inc:
            for var in ("FLASHINFER_EXTRA_CUDAFLAGS", "FLASHINFER_EXTRA_CFLAGS"):
                env[var] = " ".join(x for x in (base.get(var, ""), inc) if x)
        lib = " ".join(f"-L{shlex.quote(str(d))}" for d in self.link_dirs)
        if lib:
            env["FLASHINFER_EXTRA_LDFLAGS"] = " ".join(x for x in (base.get("FLASHINFER_EXTRA_LDFLAGS", ""), lib) if x)
        return env

    def describe(self) -> dict:
        return {"cuda_home": str(self.cuda_home), "nvcc_version": self.nvcc_version,
                "extra_include_dirs": [str(d) for d in self.include_dirs],
                "extra_link_dirs": [str(d) for d in self.link_dirs],
                "libcuda_stub": str(self.libcuda_stub) if self.libcuda_stub else None}


def _is_toolkit(d: Path) -> bool:
    return (d / "bin" / "nvcc").is_file() and (d / "include" / "cuda_runtime.h").is_file()


def find_cuda_home(environ: dict[str, str] | None = None) -> Path:
    """CUDA_HOME / CUDA_PATH, else the toolkit of the nvcc on PATH, else /usr/local/cuda."""
    environ = os.environ if environ is None else environ
    candidates: list[Path] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(var):
            candidates.append(Path(environ[var]))
    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    if nvcc:
        real = Path(nvcc).resolve()
        candidates.append(real.parent.parent)
        candidates.extend(_toolkit_named_in_script(real))
    candidates.append(Path("/usr/local/cuda"))
    for c in candidates:
        if _is_toolkit(c):
            return c
    tried = ", ".join(str(c) for c in candidates)
    raise ToolchainError(
        f"precompile needs nvcc and the CUDA headers and found neither (looked in {tried}); install a CUDA toolkit "
        "(12.8 or newer, 13.x for the sm90a FP8 paths) and set CUDA_HOME")


def _toolkit_named_in_script(nvcc: Path) -> list[Path]:
    """A wrapper script such as ``exec /usr/local/cuda-13.0/bin/nvcc "$@"`` names the real toolkit."""
    try:
        if nvcc.stat().st_size > 4096:
            return []
        text = nvcc.read_text(errors="ignore")
    except OSError:
        return []
    return [Path(m).parent.parent for m in re.findall(r"(/\S+/bin/nvcc)\b", text)]


def nvcc_version(cuda_home: Path) -> str:
    out = subprocess.run([str(cuda_home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, timeout=60)
    m = re.search(r"release (\d+\.\d+)", out.stdout)
    if out.returncode != 0 or not m:
        raise ToolchainError(f"{cuda_home / 'bin' / 'nvcc'} --version failed: {(out.stderr or out.stdout).strip()[:300]}")
    return m.group(1)


def _python_package_include_dirs(cuda_major: str) -> list[Path]:
    """Include directories of the nvidia-* wheels (``nvidia/cu13/include`` or ``nvidia/cublas/include``)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    dirs: list[Path] = []
    for root in roots:
        for sub in (f"cu{cuda_major}/include", "cublas/include", "curand/include", "cuda_nvrtc/include"):
            d = Path(root) / sub
            if d.is_dir():
                dirs.append(d)
    return dirs


def find_header_dirs(cuda_home: Path, cuda_major: str, extra: list[str] | None = None) -> list[Path]:
    """Directories to add so that every header in ``REQUIRED_HEADERS`` is found; [] when the toolkit has them."""
    missing = [h for h in REQUIRED_HEADERS if not (cuda_home / "include" / h).is_file()]
    if not missing:
        return []
    candidates = [Path(e).expanduser() for e in (extra or [])] + _python_package_include_dirs(cuda_major)
    chosen: list[Path] = []
    for header in missing:
        for d in candidates:
            if (d / header).is_file():
                if d not in chosen:
                    chosen.append(d)
                break
        else:
            pkgs = header_packages(missing, cuda_major)
            raise ToolchainError(
                f"the CUDA toolkit at {cuda_home} lacks {', '.join(missing)} (needed by FlashInfer's kernels). "
                f"Install the headers with `pip install {pkgs}` (CUDA {cuda_major} builds; the wheels are large, and "
                "only their include/ directories are needed), or pass the directory holding them with "
                "`--cuda-include DIR` (or MOESERVE_CUDA_INCLUDE=DIR)")
    return chosen


def _linker_finds(cuda_home: Path, lib: str) -> Path | None:
    """A ``lib`` (e.g. ``libcuda.so``) the link step (``-L$cuda_home/lib64 -L$cuda_home/lib64/stubs``) can use."""
    dirs = [cuda_home / "lib64", cuda_home / "lib64" / "stubs", Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"),
            Path("/usr/lib/aarch64-linux-gnu"), Path("/lib/x86_64-linux-gnu"), Path("/usr/lib")]
    for d in dirs:
        if (d / lib).exists():
            return d
    return None


def _toolkit_stub_dir(cuda_home: Path, lib: str) -> Path | None:
    """The toolkit's own stub directory when it is not where FlashInfer's link line looks."""
    for d in sorted(cuda_home.glob("targets/*/lib/stubs")) + [cuda_home / "lib" / "stubs"]:
        if (d / lib).exists():
            return d
    return None


STUB_HEADERS = {"libcuda.so": "cuda.h", "libnvrtc.so": "nvrtc.h"}
_API_NAME = re.compile(r"\b((?:cu|nvrtc)[A-Z]\w*)\b")


def api_names(header: Path) -> list[str]:
    """Every ``cu*`` / ``nvrtc*`` function name a header declares or maps a name to (``#define cuX cuX_v2``)."""
    text = header.read_text(errors="replace")
    return sorted(set(_API_NAME.findall(text)))


def make_stub(directory: Path, lib: str, soname: str, header: Path | None = None) -> Path:
    """A stand-in ``lib`` with the real one's ``soname`` that defines every function ``header`` names.

    The definitions matter: a library the linker finds no used symbol in is dropped from the module's
    ``NEEDED`` list (``--as-needed``, the default of many toolchains), and then the driver or NVRTC symbols
    the module calls stay unresolved when it is loaded on the GPU machine.
    """
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / lib
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise ToolchainError(f"there is no {lib} to link FlashInfer's modules against, and no C compiler "
                             "(gcc) to make a stub with; install gcc or the CUDA toolkit's stubs")
    names = api_names(header) if header is not None and header.is_file() else []
    source = "".join(f"void {n}(void) {{}}\n" for n in names)
    r = subprocess.run([cc, "-shared", "-fPIC", "-x", "c", "-", "-o", str(out), f"-Wl,-soname,{soname}"],
                       input=source, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise ToolchainError(f"making a {lib} stub with {cc} failed: {r.stderr.strip()[:300]}")
    return out


def make_libcuda_stub(directory: Path, header: Path | None = None) -> Path:
    """A stand-in driver library (soname ``libcuda.so.1``) defining the driver API ``header`` declares."""
    return make_stub(directory, "libcuda.so", "libcuda.so.1", header)


def _find_header(name: str, cuda_home: Path, include_dirs: list[Path]) -> Path | None:
    for d in [cuda_home / "include", *include_dirs]:
        if (d / name).is_file():
            return d / name
    return None


def prepare_toolchain(support_dir: Path, extra_includes: list[str] | None = None,
                      environ: dict[str, str] | None = None) -> Toolchain:
    """Find nvcc and the headers, and make a libcuda stub under ``support_dir`` when none can be linked.

    Header directories come from ``extra_includes`` (``--cuda-include``), then ``MOESERVE_CUDA_INCLUDE``
    (``os.pathsep``-separated), then the installed nvidia-cublas / nvidia-curand wheels.
    """
    environ = os.environ if environ is None else environ
    cuda_home = find_cuda_home(environ)
    version = nvcc_version(cuda_home)
    extra = list(extra_includes or []) + [d for d in environ.get("MOESERVE_CUDA_INCLUDE", "").split(os.pathsep) if d]
    major = version.split(".")[0]
    tc = Toolchain(cuda_home, version, find_header_dirs(cuda_home, major, extra))
    for lib, soname in (("libcuda.so", "libcuda.so.1"), ("libnvrtc.so", f"libnvrtc.so.{major}")):
        if _linker_finds(cuda_home, lib) is not None:
            continue
        stub_dir = _toolkit_stub_dir(cuda_home, lib)
        if stub_dir is None:
            header = _find_header(STUB_HEADERS[lib], cuda_home, tc.include_dirs)
            stub = make_stub(support_dir / "lib", lib, soname, header)
            if lib == "libcuda.so":
                tc.libcuda_stub = stub
            stub_dir = stub.parent
        if stub_dir not in tc.link_dirs:
            tc.link_dirs.append(stub_dir)
    return tc
