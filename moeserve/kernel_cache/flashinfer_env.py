"""Environment FlashInfer reads at import time; imported by every module that imports flashinfer.

moeserve uses FlashInfer's CUDA RMSNorm kernels (``FLASHINFER_USE_CUDA_NORM=1``) rather than its CuTe-DSL
ones, so that norm is an ordinary JIT module that ``moeserve precompile`` can build ahead of time.

Importing this module also hooks FlashInfer's JIT loader (``moeserve.kernel_cache.jit_hook``): every module
FlashInfer loads is recorded, one about to compile is named in the log first, and modules of a moeserve
kernel cache are loaded from it.
"""
import os

os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")

from moeserve.kernel_cache import jit_hook as _jit_hook  # noqa: E402

_jit_hook.install()
