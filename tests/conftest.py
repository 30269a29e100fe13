import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("MOESERVE_KERNEL_CACHE") and torch.cuda.is_available():
    # GPU runs: load FlashInfer's modules from a cache made by `moeserve precompile` (before anything imports
    # flashinfer), so the suite compiles only what that cache lacks
    from moeserve.hardware import probe
    from moeserve.kernel_cache import use_kernel_cache
    use_kernel_cache(os.environ["MOESERVE_KERNEL_CACHE"], probe())
# HTTP calls in the tests wait up to 60 s unless they say otherwise: httpx's 5 s default is shorter than a
# request can take on a loaded 2-core machine, which made tests fail now and then for no fault of the server.
try:
    import httpx

    def _patient(fn):
        def call(*args, timeout=60.0, **kwargs):
            return fn(*args, timeout=timeout, **kwargs)
        call.__wrapped__ = fn
        return call

    for _name in ("get", "post", "stream"):
        setattr(httpx, _name, _patient(getattr(httpx, _name)))
except ImportError:  # the server and bench extras are not installed
    pass
# The test models are tiny: one intra-op thread is as fast, and immune to OpenMP spin-waiting when the
# few cores of a CI machine are shared with server threads and subprocesses.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
