"""The kernels an engine loads, readied before the model is built: FlashInfer's modules and Triton's kernels
from the kernel cache (``kernel_cache_dir``), every compile counted, and with ``allow_jit: false`` anything the
configuration needs that the cache lacks refused at start by name."""
from __future__ import annotations

import logging

from moeserve.kernel_cache import jit_hook, use_kernel_cache
from moeserve.kernel_cache.layout import KernelCacheError
from moeserve.kernel_cache.triton_cache import install_listener, triton_summary, use_triton_cache
from moeserve.plan import RuntimePlan

log = logging.getLogger("moeserve")


def missing_flashinfer_modules(plan: RuntimePlan) -> list[str]:
    """The FlashInfer modules the plan loads that the active kernel cache does not hold."""
    from moeserve.kernel_cache.modules import make_spec
    missing = []
    for m in plan.flashinfer_modules():
        spec = make_spec(m)
        if jit_hook.cache_lookup(spec.name) is None and not getattr(spec, "is_aot", False):
            missing.append(f"{m.key} ({spec.name})")
    return missing


def prepare_kernels(plan: RuntimePlan) -> dict:
    """Point FlashInfer and Triton at the kernel cache; returns what was set up, for the start-up report."""
    cfg = plan.config
    out = {"flashinfer": None, "triton": None}
    if plan.device.type != "cuda":
        return out
    jit_hook.set_allow_jit(cfg.allow_jit)
    if cfg.kernel_cache_dir is None:
        if not cfg.allow_jit:
            raise KernelCacheError("allow_jit: false needs kernel_cache_dir (a kernel cache made by `moeserve "
                                   "precompile`); without one every kernel compiles on first use")
        install_listener(True)
        return out
    out["flashinfer"] = use_kernel_cache(cfg.kernel_cache_dir, plan.hardware)
    if not cfg.allow_jit:
        missing = missing_flashinfer_modules(plan)
        if missing:
            raise KernelCacheError(f"kernel_cache_dir {cfg.kernel_cache_dir} lacks {len(missing)} FlashInfer "
                                   f"module(s) this configuration loads: {', '.join(missing)} (allow_jit: false)")
    from moeserve.ops.moe.triton_configs import device_name
    out["triton"] = use_triton_cache(cfg.kernel_cache_dir, plan.triton_fingerprint(device_name()), cfg.allow_jit)
    return out


def kernels_summary() -> str:
    """FlashInfer's and Triton's load/compile counts, for the ready log."""
    return f"{jit_hook.startup_summary()}; {triton_summary()}"
