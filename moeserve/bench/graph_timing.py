"""Timing kernels as a decode step runs them: captured back to back in one CUDA graph and replayed."""
from __future__ import annotations

import statistics

import torch


def time_in_graph_us(calls: list, replays: int = 20, warm_replays: int = 1) -> float:
    """Median microseconds per call of ``calls`` (argument-less callables) captured back to back in one CUDA
    graph and replayed ``replays`` times (the higher of the two middle times for an even count). Each call runs
    once before the capture (compiles stay out), and the graph ``warm_replays`` times before the timed ones."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(warm_replays):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median_high(times)
