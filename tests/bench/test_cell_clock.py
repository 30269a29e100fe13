"""The benchmark's per-cell progress: elapsed time and an estimate of the time left."""
from moeserve.bench import workloads
from moeserve.bench.workloads import CellClock, WorkloadCase


def test_the_estimate_is_the_mean_cell_time_times_the_cells_to_go(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(workloads.time, "monotonic", lambda: now[0])
    clock = CellClock(4)
    case = WorkloadCase("decode", 8, 16, 4)
    assert clock.start_line(case) == "cell 1/4 decode c=8: 0 s elapsed, estimating the time left"
    now[0] += 30
    clock.finished()
    now[0] += 50
    clock.finished()
    assert clock.remaining() == 80.0  # 40 s a cell, 2 to go
    assert clock.start_line(case) == "cell 3/4 decode c=8: 1 min 20 s elapsed, about 1 min 20 s left"
