"""From a configuration to what will run: the one place a config is resolved into the model's
architecture, the device, the dtypes, the weight format and the backend of every operator.

The engine, ``moeserve env``, ``moeserve precompile`` and the benchmark all call ``resolve_plan``; a
problem with the combination (a backend this GPU cannot run, a ``max_model_len`` beyond the model's, a
GPU architecture other than the one asked for) is raised here, before anything is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve import backends
from moeserve.config import EngineConfig, ModelSource, resolve_dtype, resolve_model_source
from moeserve.hardware import HardwareInfo, check_gpu_arch, probe, resolve_device
from moeserve.models import arch_from_hf
from moeserve.models.arch import ArchConfig
from moeserve.quant.config import engine_quantization


@dataclass
class RuntimePlan:
    config: EngineConfig
    source: ModelSource
    arch: ArchConfig
    hardware: HardwareInfo
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    quantization: str  # none | fp8
    max_model_len: int
    backends: dict[str, backends.BackendSpec]

    @property
    def backend_names(self) -> dict[str, str]:
        return {op: spec.name for op, spec in self.backends.items()}

    def backend_class(self, op: str):
        return backends.load(self.backends[op])

    def explicit(self, op: str) -> bool:
        """Whether the config named this operator's backend (rather than ``auto``)."""
        return getattr(self.config.backends, op) != "auto"


def resolve_plan(cfg: EngineConfig, hw: HardwareInfo | None = None, device: torch.device | None = None,
                 source: ModelSource | None = None, with_backends: bool = True) -> RuntimePlan:
    """Resolve ``cfg`` for this machine (``hw``/``device`` default to the probe and ``cfg.device``), or for a
    described target machine when both are given (``moeserve precompile --arch``). ``with_backends=False``
    leaves ``backends`` empty (a report that must stand even when a backend cannot run)."""
    real = hw is None
    hw = probe() if hw is None else hw
    device = resolve_device(cfg.device) if device is None else device
    if real:
        check_gpu_arch(cfg.gpu_arch, device)
    source = source or resolve_model_source(cfg.model, cfg.weights_dir, cfg.revision)
    arch = arch_from_hf(source.config)
    dtype = resolve_dtype(cfg.dtype, arch.torch_dtype, device)
    if cfg.kv_cache_dtype != "auto":
        raise NotImplementedError(f"kv_cache_dtype: {cfg.kv_cache_dtype!r} is not supported by this build "
                                  "(the KV cache is kept in the model dtype; use kv_cache_dtype: auto)")
    max_model_len = cfg.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(f"max_model_len: {max_model_len} exceeds the model's max_position_embeddings "
                         f"({arch.max_position_embeddings})")
    quantization = engine_quantization(cfg, source.config)
    specs = {op: backends.resolve(op, getattr(cfg.backends, op), hw, device, dtype, quantization, arch.head_dim)
             for op in backends.OPERATORS} if with_backends else {}
    return RuntimePlan(cfg, source, arch, hw, device, dtype, dtype, quantization, max_model_len, specs)
