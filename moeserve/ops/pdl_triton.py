"""The device side of programmatic dependent launch (``moeserve.ops.pdl``): what a kernel that takes ``PDL`` calls
first."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_prior(PDL: tl.constexpr, LET_NEXT: tl.constexpr = True):
    """With ``PDL``: wait until the kernel before this one in the stream has completed and its writes are
    visible; with ``LET_NEXT`` too, let the kernel after this one be scheduled now (it waits likewise before
    touching memory; without, it may start once every program of this one has called :func:`let_next_start` or
    exited)."""
    if PDL:
        gdc_wait()
        if LET_NEXT:
            gdc_launch_dependents()


@triton.jit
def let_next_start(PDL: tl.constexpr):
    """With ``PDL``: this program no longer holds back the scheduling of the next kernel."""
    if PDL:
        gdc_launch_dependents()
