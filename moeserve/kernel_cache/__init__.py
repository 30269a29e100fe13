"""The kernel-cache runtime: FlashInfer's environment and JIT hook, and the relocatable kernel cache the
engine loads its FlashInfer modules from (made by ``moeserve precompile``, in ``moeserve.tools``).

- ``artifact_report(hw)``: FlashInfer's packages and caches (shown by ``moeserve env``).
- ``use_kernel_cache(path, hw)``: point FlashInfer at a cache made by ``moeserve precompile`` (the engine
  calls it when ``kernel_cache_dir`` is set, before FlashInfer is imported).
- ``jit_events()`` / ``startup_summary()``: every FlashInfer module this process loaded, and whether it
  had to compile (recorded by the hook ``moeserve.kernel_cache.flashinfer_env`` installs).

Importing this package does not import FlashInfer or torch.
"""
from __future__ import annotations

from moeserve.kernel_cache.jit_hook import clear_jit_events, jit_events, startup_summary
from moeserve.kernel_cache.layout import KernelCacheError, parse_arch

__all__ = ["artifact_report", "use_kernel_cache", "jit_events", "clear_jit_events", "startup_summary",
           "KernelCacheError", "parse_arch"]


def artifact_report(hw) -> dict:
    from moeserve.kernel_cache.cache import artifact_report as report
    return report(hw)


def use_kernel_cache(path, hw) -> dict:
    from moeserve.kernel_cache.cache import use_kernel_cache as use
    return use(path, hw)
