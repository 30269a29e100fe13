"""What this machine is: GPUs and their compute capability, memory, and the versions of the kernel libraries.

The probe runs first, before any kernel is chosen; ``moeserve.backends`` reads it to decide which
operator backends this machine can run.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import torch

# Below this compute capability moeserve runs no GPU kernels at all (FlashInfer's floor).
MIN_CAPABILITY = (7, 5)


@dataclass(frozen=True)
class GPUInfo:
    index: int
    name: str
    capability: tuple[int, int]
    total_memory_bytes: int
    multiprocessors: int

    @property
    def arch(self) -> str:
        """FlashInfer/nvcc style architecture name: 9.0a for Hopper, 10.0a for Blackwell, 8.9 for Ada."""
        major, minor = self.capability
        suffix = "a" if major >= 9 else ""
        return f"{major}.{minor}{suffix}"

    @property
    def sm(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"


@dataclass
class HardwareInfo:
    device_type: str  # "cuda" or "cpu"
    gpus: list[GPUInfo] = field(default_factory=list)
    driver_version: str | None = None
    cuda_runtime: str | None = None
    cpu: str = ""
    cpu_count: int = 1
    versions: dict[str, str | None] = field(default_factory=dict)

    @property
    def gpu(self) -> GPUInfo | None:
        return self.gpus[0] if self.gpus else None

    @property
    def capability(self) -> tuple[int, int] | None:
        return self.gpu.capability if self.gpu else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gpus"] = [dict(asdict(g), arch=g.arch) for g in self.gpus]
        return d


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


# nvidia-smi topo -m: how two GPUs reach each other, fastest first
LINK_KINDS = {"NV": "NVLink", "PIX": "PCIe, one switch", "PXB": "PCIe, several switches", "PHB": "PCIe, host bridge",
              "NODE": "PCIe, host bridges of one NUMA node", "SYS": "PCIe and the CPUs' interconnect"}


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """``{(i, j): "NV18"}`` for every pair of GPUs of an ``nvidia-smi topo -m`` matrix."""
    import re
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln).rstrip() for ln in text.splitlines()]
    header = next((ln.split("\t") for ln in lines if ln.strip().startswith("GPU0")), None)
    if header is None:
        return {}
    cols = [c.strip() for c in header]
    gpus = {k: int(c[3:]) for k, c in enumerate(cols) if re.fullmatch(r"GPU\d+", c)}
    out = {}
    for ln in lines:
        cells = [c.strip() for c in ln.split("\t")]
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        i = int(cells[0][3:])
        for k, j in gpus.items():  # the header starts with an empty cell above the rows' names
            if k < len(cells) and i != j:
                out[(i, j)] = cells[k]
    return out


def describe_link(code: str) -> str:
    """``NV18`` -> ``NVLink (18 links)``; PCIe codes in words."""
    if code.startswith("NV") and code[2:].isdigit():
        return f"NVLink ({code[2:]} links)"
    return LINK_KINDS.get(code, code)


def gpu_topology() -> dict[str, str] | None:
    """How each pair of GPUs is connected (``{"GPU0-GPU1": "NVLink (18 links)"}``), from ``nvidia-smi topo -m``;
    None where there is no nvidia-smi or fewer than two GPUs."""
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    links = parse_topology(out.stdout) if out.returncode == 0 else {}
    return {f"GPU{i}-GPU{j}": describe_link(c) for (i, j), c in sorted(links.items()) if i < j} or None


@lru_cache(maxsize=1)
def probe() -> HardwareInfo:
    """Read the machine once per process."""
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "flashinfer": package_version("flashinfer-python"),
        "flashinfer-cubin": package_version("flashinfer-cubin"),
        "flashinfer-jit-cache": package_version("flashinfer-jit-cache"),
        "vllm": package_version("vllm"),
        "transformers": package_version("transformers"),
    }
    info = HardwareInfo(
        device_type="cpu", cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count() or 1,
        versions=versions,
    )
    if torch.cuda.is_available():
        info.device_type = "cuda"
        info.cuda_runtime = torch.version.cuda
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info.gpus.append(GPUInfo(i, p.name, (p.major, p.minor), p.total_memory, p.multi_processor_count))
        info.driver_version = _driver_version()
    return info


class DeviceError(RuntimeError):
    """The device the config asks for is not here (or not usable); the message names it."""


def resolve_device(requested: str) -> torch.device:
    """``auto`` means the first GPU when there is a usable one, else the CPU; asking for cuda without one fails."""
    hw = probe()
    if requested == "auto":
        if hw.gpu is not None and hw.gpu.capability >= MIN_CAPABILITY:
            return torch.device("cuda", 0)
        return torch.device("cpu")
    dev = torch.device(requested)
    if dev.type == "cuda":
        if hw.gpu is None:
            raise DeviceError(f"device: {requested!r} was asked for but this machine has no CUDA GPU")
        idx = dev.index or 0
        if idx >= len(hw.gpus):
            raise DeviceError(f"device: {requested!r} does not exist; this machine has {len(hw.gpus)} GPU(s)")
        gpu = hw.gpus[idx]
        if gpu.capability < MIN_CAPABILITY:
            raise DeviceError(
                f"device: {gpu.name} is {gpu.sm}; moeserve's GPU kernels need sm75 or newer")
        return torch.device("cuda", idx)
    return dev


def check_gpu_arch(expected: str | None, device: torch.device) -> None:
    """Refuse to run when the config names a GPU architecture other than the one present."""
    if expected is None or device.type != "cuda":
        return
    gpu = probe().gpus[device.index or 0]
    if expected.rstrip("af") != gpu.arch.rstrip("af"):
        raise DeviceError(f"gpu_arch: the config asks for {expected} but {gpu.name} is {gpu.arch}")
