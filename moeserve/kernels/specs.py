"""FlashInfer module specs that moeserve builds differently from FlashInfer's defaults.

``cutlass_fused_moe`` (TensorRT-LLM's CUTLASS MoE) compiles every tile shape and cluster shape of every
dtype pair: 182 translation units and hours of one core each for the sm90 module. TensorRT-LLM's
``FAST_BUILD`` keeps one tile (CTA 128x128, cluster 1x1x1) per kernel and turns the rest into a clear
runtime error; its heuristic then proposes only that tile. FlashInfer's ``use_fast_build=True`` passes the
macro to the host compiler only, so the kernels are still all built. The spec here passes it to nvcc too.
The module keeps FlashInfer's name (``fused_moe_90``), so FlashInfer's own ``cutlass_fused_moe`` loads it
from moeserve's kernel cache.
"""
from __future__ import annotations

import dataclasses

FAST_BUILD_FLAG = "-DFAST_BUILD"


def gen_cutlass_fused_moe_fast_build(gen_name: str):
    """The ``JitSpec`` of ``flashinfer.jit.fused_moe.<gen_name>(use_fast_build=True)`` with ``FAST_BUILD``
    in the CUDA flags as well as the host flags."""
    from flashinfer.jit import fused_moe

    spec = getattr(fused_moe, gen_name)(True)
    cuda_flags = list(spec.extra_cuda_cflags or [])
    if FAST_BUILD_FLAG not in cuda_flags:
        cuda_flags.append(FAST_BUILD_FLAG)
    return dataclasses.replace(spec, extra_cuda_cflags=cuda_flags)
