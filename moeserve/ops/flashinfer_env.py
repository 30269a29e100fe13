"""Environment FlashInfer reads at import time; imported by every module that imports flashinfer.

moeserve uses FlashInfer's CUDA RMSNorm kernels (``FLASHINFER_USE_CUDA_NORM=1``) rather than its CuTe-DSL
ones, so that norm is an ordinary JIT module that ``moeserve precompile`` can build ahead of time.
"""
import os

os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")
