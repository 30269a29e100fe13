import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
