"""FlashInfer module specs that moeserve builds differently from FlashInfer's defaults.

``cutlass_fused_moe`` (TensorRT-LLM's CUTLASS MoE) compiles every tile shape and cluster shape of every
dtype pair: 182 translation units and hours of one core each for the sm90 module. TensorRT-LLM's
``FAST_BUILD`` keeps one tile (CTA 128x128, cluster 1x1x1) per kernel and turns the rest into a clear
runtime error; its heuristic then proposes only that tile. FlashInfer's ``use_fast_build=True`` passes the
macro to the host compiler only, so the kernels are still all built. The spec here passes it to nvcc too.
The module keeps FlashInfer's name (``fused_moe_90``), so FlashInfer's own ``cutlass_fused_moe`` loads it
from moeserve's kernel cache.

FlashInfer's spec also compiles every generated instantiation file it finds, including the non-grouped
``gemm/`` ones: the weight-only mixed-input GEMM launchers (``sm90_generic_mixed_gemm_kernelLauncher``)
of its ``fpA_intB`` GEMM, which none of the MoE module's sources references. The spec here leaves them out
(48 of 182 sources on sm90).
"""
from __future__ import annotations

import dataclasses
from pathlib import PurePath

FAST_BUILD_FLAG = "-DFAST_BUILD"


def gen_cutlass_fused_moe_fast_build(gen_name: str):
    """The ``JitSpec`` of ``flashinfer.jit.fused_moe.<gen_name>(use_fast_build=True)`` with ``FAST_BUILD``
    in the CUDA flags as well as the host flags."""
    from flashinfer.jit import fused_moe

    spec = getattr(fused_moe, gen_name)(True)
    cuda_flags = list(spec.extra_cuda_cflags or [])
    if FAST_BUILD_FLAG not in cuda_flags:
        cuda_flags.append(FAST_BUILD_FLAG)
    sources = [src for src in spec.sources if not is_mixed_gemm_instantiation(src)]
    return dataclasses.replace(spec, extra_cuda_cflags=cuda_flags, sources=sources)


def is_mixed_gemm_instantiation(path) -> bool:
    """A generated non-grouped ``gemm/<arch>/...generated.cu`` file (fpA_intB launchers, unused by the MoE)."""
    parts = PurePath(path).parts
    return str(path).endswith(".generated.cu") and len(parts) >= 3 and parts[-3] == "gemm"
