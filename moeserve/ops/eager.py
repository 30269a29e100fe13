"""Custom kernel launches that ``torch.compile`` (``torch_compile: true``) must run eagerly.

``torch.compiler.disable`` imports TorchDynamo when it decorates, about 2 s of every engine start whether or not
anything is compiled. So the backends mark such methods with :func:`eager`, which only records them, and the
runner calls :func:`apply_eager_marks` before it compiles anything: only then is each marked method replaced
on its class by its ``torch.compiler.disable`` wrapper.
"""
from __future__ import annotations

import importlib

_MARKED: list = []


def eager(fn):
    """Mark a method (a Triton, CUTLASS or FlashInfer launch) to run eagerly under torch.compile."""
    _MARKED.append(fn)
    return fn


def apply_eager_marks() -> int:
    """Wrap every marked method with ``torch.compiler.disable`` on its class (idempotent); returns how many
    were wrapped now."""
    import torch
    done = 0
    for fn in _MARKED:
        owner = importlib.import_module(fn.__module__)
        *path, name = fn.__qualname__.split(".")
        for part in path:
            owner = getattr(owner, part)
        if owner.__dict__.get(name) is fn:
            setattr(owner, name, torch.compiler.disable(fn))
            done += 1
    return done


def marked() -> list:
    return list(_MARKED)
