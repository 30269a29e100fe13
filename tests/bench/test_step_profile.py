"""The step profiler's timeline: what runs on the critical path, what waits, what overlaps (synthetic traces)."""
import json

import pytest
import torch

from moeserve.bench.step_profile import kernels_from_trace, timeline


def _kernel(name, stream, ts, dur, grid=(1, 1, 1)):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "grid": list(grid)}}


def test_timeline_splits_a_step_into_running_waiting_and_overlapped_time():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},  # host events are not kernels
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 1},
        _kernel("gemv", 7, 0, 10),
        _kernel("norm", 7, 12, 8),              # waited 2 us for its launch
        _kernel("shared_mlp", 13, 13, 12),      # the side stream, beside the main one
        _kernel("moe", 7, 19, 11, grid=(4, 2, 1)),  # started 1 us before "norm" ended (PDL)
        # a second step: the same kernels, one gap of 20 us between the steps (the host)
        _kernel("gemv", 7, 50, 10),
        _kernel("norm", 7, 62, 8),
        _kernel("shared_mlp", 13, 63, 12),
        _kernel("moe", 7, 69, 11, grid=(4, 2, 1)),
    ]}
    ks = kernels_from_trace(trace)
    assert [k[0] for k in ks] == ["gemv", "norm", "shared_mlp", "moe"] * 2
    t = timeline(ks, steps=2)
    assert t["window_us_per_step"] == pytest.approx(40.0)
    assert t["gpu_busy_us_per_step"] == pytest.approx(28.0)
    assert t["gpu_idle_us_per_step"] == pytest.approx(12.0)
    gaps = {b["gap"]: (b["per_step"], b["us_per_step"]) for b in t["idle_gaps"]}
    assert gaps["1-3 us"] == (1.0, 2.0) and gaps[">= 10 us"] == (0.5, 10.0) and gaps["0-1 us"] == (0.0, 0.0)
    m = t["main_stream"]
    assert m["kernels_per_step"] == 3 and m["kernel_us_per_step"] == pytest.approx(29.0)
    # leads: norm +2 (twice), moe -1 (twice), gemv of the second step +20 (after the first step's moe)
    assert m["waiting_us_per_step"] == pytest.approx((2 + 2 + 20) / 2)
    assert m["overlapped_us_per_step"] == pytest.approx(1.0)
    assert t["side_streams"] == {"13": {"kernels_per_step": 1.0, "kernel_us_per_step": 12.0}}
    rows = [(r["name"], r["grid"], r["us_each"], r["lead_us_each"]) for r in t["critical_path"]]
    assert rows == [("gemv", "[1, 1, 1]", 10.0, 20.0), ("norm", "[1, 1, 1]", 8.0, 2.0),
                    ("moe", "[4, 2, 1]", 11.0, -1.0)]


def test_kernels_with_one_name_and_different_grids_are_told_apart():
    trace = {"traceEvents": [_kernel("fused_moe_kernel", 7, 0, 5, grid=(176, 1, 1)),
                             _kernel("fused_moe_kernel", 7, 6, 3, grid=(128, 1, 1))]}
    t = timeline(kernels_from_trace(trace), steps=1)
    assert [(r["grid"], r["us_each"]) for r in t["critical_path"]] == [("[176, 1, 1]", 5.0), ("[128, 1, 1]", 3.0)]


def test_a_cpu_only_profiler_trace_has_no_kernels(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8) @ torch.ones(8)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    assert kernels_from_trace(json.loads(path.read_text())) == []
    assert timeline([], steps=4) == {}
