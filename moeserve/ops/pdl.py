"""Programmatic dependent launch (PDL) for moeserve's Triton kernels.

A decode step of a few tokens is a chain of several hundred small kernels, each waiting for the one before: a
kernel's thread blocks are only scheduled once the previous kernel has finished and its writes are flushed,
and that gap, paid at every launch, is a large part of a one-token step. On compute capability 9.0 and later a
kernel launched with PDL (``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``; a programmatic edge when
captured in a CUDA graph) may be scheduled while the kernel before it is still running; it blocks in
``griddepcontrol.wait`` until that kernel has completed and its memory is visible. FlashInfer launches its
norm, attention and activation kernels this way on Hopper by default; with ``enable_pdl`` moeserve's Triton
kernels (the QKV kernel, the router, routing, fused MoE and its alignment and combine, the GEMV) do too.

Each such kernel takes a ``PDL`` constexpr and starts with ``pdl_triton.wait_prior``: it waits for the previous kernel
before it reads or writes anything (so no hazard depends on what a kernel reads later), then lets the next one
be scheduled. ``PDL`` false compiles the kernel as before; the Triton interpreter runs it that way.

The switch is process-wide (:func:`configure`): the engine sets it from its plan at start, before it warms or
captures anything; ``moeserve precompile`` sets it from the plan of the target while it compiles. (This module
imports nothing: the engine reads it on machines without Triton.)
"""
from __future__ import annotations

import contextlib

_state = {"on": False}


def configure(on: bool) -> None:
    """Launch moeserve's Triton kernels with PDL from now on (``on``), or without."""
    _state["on"] = bool(on)


def enabled() -> bool:
    return _state["on"]


@contextlib.contextmanager
def enabled_as(on: bool):
    """Inside: :func:`configure` ``(on)``; the previous setting afterwards."""
    saved = _state["on"]
    configure(on)
    try:
        yield
    finally:
        configure(saved)


def launch_kwargs() -> dict:
    """The keyword arguments of a launch of a kernel that takes ``PDL``: the constexpr and Triton's launch
    option, or nothing (the kernel's default, ``PDL=False``)."""
    return {"PDL": True, "launch_pdl": True} if _state["on"] else {}
