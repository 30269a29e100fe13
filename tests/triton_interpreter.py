"""Running Triton kernels on the CPU: under Triton's interpreter, in a subprocess.

``TRITON_INTERPRET=1`` must be set before a kernel is defined, so a test module runs itself as a worker:
``run_worker`` saves the inputs, starts ``python TEST_FILE --interpreter-worker IN OUT`` with the interpreter
on, and loads what the worker saved. The worker calls ``patch_for_numpy`` first, then its kernels.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
WORKER_FLAG = "--interpreter-worker"


def patch_for_numpy():
    """Triton 3.6's interpreter converts size-1 arrays with ``int()``, an error from NumPy 2.4 on."""
    import triton.runtime.interpreter as interp
    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def worker_env(**extra: str) -> dict:
    """The environment of a test module run as a subprocess: this checkout and ``tests/`` first on its path."""
    return dict(os.environ, **extra,
                PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def run_worker(test_file: str, inputs, workdir: Path, seed: int, timeout: float = 600):
    """Save ``inputs`` in ``workdir``, run ``test_file``'s worker on them under the interpreter, and return
    what it saved; a failing worker fails the calling test with its output and ``seed``."""
    src, dst = workdir / "in.pt", workdir / "out.pt"
    torch.save(inputs, src)
    env = worker_env(TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, test_file, WORKER_FLAG, str(src), str(dst)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"interpreter worker failed (seed {seed}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return torch.load(dst)


def is_worker(argv: list[str]) -> bool:
    return argv[1:2] == [WORKER_FLAG]
