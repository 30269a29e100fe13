"""The device side of programmatic dependent launch (``moeserve.ops.pdl``): what a kernel that takes ``PDL`` calls
first."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """With ``PDL``: wait until the kernel before this one in the stream has completed and its writes are
    visible, then let the kernel after this one be scheduled (it waits likewise before touching memory)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
