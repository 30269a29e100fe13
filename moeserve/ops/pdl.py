"""Programmatic dependent launch (PDL) for moeserve's Triton kernels.

A decode step of a few tokens is a chain of several hundred small kernels, each waiting for the one before: a
kernel's thread blocks are only scheduled once the previous kernel has finished and its writes are flushed,
and that gap, paid at every launch, is a large part of a one-token step. On compute capability 9.0 and later a
kernel launched with PDL (``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``; a programmatic edge when
captured in a CUDA graph) may be scheduled while the kernel before it is still running; it blocks in
``griddepcontrol.wait`` until that kernel has completed and its memory is visible. FlashInfer launches its
norm, attention and activation kernels this way on Hopper by default; for steps of up to ``pdl_max_tokens``
tokens moeserve's Triton kernels (the QKV kernel, the router, routing, fused MoE and its alignment and combine,
the GEMV) do too.

Each such kernel takes a ``PDL`` constexpr and starts with ``pdl_triton.wait_prior``: it waits for the kernel
before it ahead of reading or writing anything (so no hazard depends on what a kernel reads later), then lets
the next one be scheduled; the fused MoE GEMM lets the next one be scheduled only after its main loop, so that
kernel's blocks do not wait on SMs that the GEMM's later blocks could run on. Exceptions read before they
wait, each only what is complete whenever it can start. The one-kernel decode attention
(``attention.decode_triton``) loads the step's positions and pages and its first block of cached keys and values:
the inputs were copied in before the step began and the cached keys written by earlier steps. And
(``moe_fused_shared_early``) in a one-token step the fused MoE's tiles of a fused shared expert read their
input before waiting, and the routing kernel before it lets it be scheduled at once: by then every router
program has passed its own wait for the norm that wrote that input (``triton_kernels.fused_moe``'s
``fixed_tail``). Where ``moe_route_in_grid`` applies (the default), such a step instead runs the router, the
routing and that GEMM as one grid (``moe.routed_moe_triton``), which waits first like the others; its routed tiles
then wait on a flag the routing sets, and only then let the down GEMM after the grid be scheduled, whose tiles read
their expert ids and first weight tiles before they wait (``DOWN_PRELOAD``). ``PDL`` false compiles the kernel as
before; the Triton interpreter runs it that way.

The switch is process-wide (:func:`configure`), by step size: the engine sets it from its plan at start, before
it warms or captures anything, and again before each step; ``moeserve precompile`` sets it from the plan of the
target while it compiles (the QKV kernel, one for every step size, both ways when the bound is below the largest
step). This module imports nothing: the engine reads it on machines without Triton.
"""
from __future__ import annotations

import contextlib

_state = {"max_tokens": 0}


def configure(max_tokens: int) -> None:
    """From now on, launches for steps of at most ``max_tokens`` tokens use PDL (0: none)."""
    _state["max_tokens"] = max(0, int(max_tokens))


def max_tokens() -> int:
    return _state["max_tokens"]


@contextlib.contextmanager
def enabled_as(max_tokens: int):
    """Inside: :func:`configure` ``(max_tokens)``; the previous setting afterwards."""
    saved = _state["max_tokens"]
    configure(max_tokens)
    try:
        yield
    finally:
        configure(saved)


def launch_kwargs(tokens: int) -> dict:
    """The keyword arguments of a launch, for a step of ``tokens`` tokens, of a kernel that takes ``PDL``: the
    constexpr and Triton's launch option, or nothing (the kernel's default, ``PDL=False``)."""
    return {"PDL": True, "launch_pdl": True} if 0 < tokens <= _state["max_tokens"] else {}
