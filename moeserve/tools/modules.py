"""Which FlashInfer JIT modules an engine configuration loads on a given GPU architecture.

The configuration is resolved as the engine resolves it (``moeserve.plan.resolve_plan``) for a machine with
one GPU of the target architecture; each operator's backend then lists its modules through the function
its ``BackendSpec.flashinfer_modules`` names (``moeserve.backends``), so the backend table is the only list.
"""
from __future__ import annotations

import torch

from moeserve.config import EngineConfig
from moeserve.hardware import GPUInfo, HardwareInfo
from moeserve.kernel_cache.layout import Arch, parse_arch
from moeserve.kernel_cache.modules import KernelModule, Target
from moeserve.plan import RuntimePlan, resolve_plan


def hardware_for_arch(arch: Arch) -> HardwareInfo:
    """A machine with one GPU of ``arch``, for asking the backend table what would run there."""
    gpu = GPUInfo(0, f"target {arch.name}", arch.capability, 0, 0)
    return HardwareInfo(device_type="cuda", gpus=[gpu])


def plan_for_arch(cfg: EngineConfig, arch: Arch | str) -> RuntimePlan:
    """``cfg`` resolved for a GPU of ``arch`` (whatever this machine has)."""
    arch = parse_arch(arch) if isinstance(arch, str) else arch
    return resolve_plan(cfg, hardware_for_arch(arch), torch.device("cuda", 0))


def _target(plan: RuntimePlan, arch: Arch) -> Target:
    m = plan.arch
    return Target(arch, plan.dtype, plan.kv_dtype, m.num_heads, m.num_kv_heads, m.head_dim, plan.quantization,
                  m.num_experts, m.routing)


def target_for_config(cfg: EngineConfig, arch: Arch | str) -> tuple[Target, dict[str, str]]:
    """The target and the backend each operator resolves to, for ``cfg`` on a GPU of ``arch``."""
    arch = parse_arch(arch) if isinstance(arch, str) else arch
    plan = plan_for_arch(cfg, arch)
    return _target(plan, arch), plan.backend_names


def modules_for_config(cfg: EngineConfig, arch: Arch | str) -> list[KernelModule]:
    """Every FlashInfer JIT module the engine configured by ``cfg`` loads on ``arch``, each once."""
    arch = parse_arch(arch) if isinstance(arch, str) else arch
    return plan_for_arch(cfg, arch).flashinfer_modules(arch)


def select_modules(modules: list[KernelModule], keys: str | None) -> list[KernelModule]:
    """The modules named in ``keys`` ("norm,rope"); all of them when None."""
    if not keys:
        return modules
    wanted = [k.strip() for k in keys.split(",") if k.strip()]
    known = {m.key for m in modules}
    unknown = [k for k in wanted if k not in known]
    if unknown:
        raise ValueError(f"--modules: {', '.join(unknown)} not among the modules this config loads "
                         f"({', '.join(m.key for m in modules)})")
    return [m for m in modules if m.key in wanted]
