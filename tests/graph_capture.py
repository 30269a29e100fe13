"""Capturing a few kernels in a CUDA graph as the engine's decode graphs do: launched with programmatic dependent
launch, run once outside the graph (kernels load there, not in the capture), captured on a side stream."""
from __future__ import annotations

import torch


def capture_with_pdl(fn, tokens: int = 1, warm=None):
    """``(graph, fn's output in the graph)``: ``warm`` (default ``fn``) run once, then ``fn`` captured, both with PDL
    for steps of ``tokens`` tokens on a stream the current one waits for."""
    from moeserve.ops import pdl
    with pdl.enabled_as(tokens):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            (warm or fn)()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s):
                out = fn()
        torch.cuda.current_stream().wait_stream(s)
    return graph, out
