"""A pytest plugin of ``scripts/gpu_suite.py --live-log FILE``: one line per test as soon as it ends, appended to
``$MOESERVE_LIVE_LOG`` and flushed: the seconds since the run started, the outcome, the test's own seconds, its id,
and for a failure the first line of its crash message. A run stopped by a time limit before pytest's summary still
says which tests ran, how long each took and why one failed."""
from __future__ import annotations

import os
import time

_T0 = time.monotonic()


def _reason(report) -> str:
    """The first line of a failure's crash message (the exception, or the assertion with its message), else the
    first line pytest marks ``E`` in its report."""
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
    lines = [ln.strip() for ln in (crash or str(report.longreprtext)).splitlines() if ln.strip()]
    if not crash:
        lines = [ln[1:].strip() for ln in lines if ln.startswith("E ")] or lines
    return (lines or [""])[0][:300]


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("MOESERVE_LIVE_LOG")
    if not path or (report.when != "call" and report.passed):  # set-up and tear-down only when they fail or skip
        return
    outcome = report.outcome.upper() if report.when == "call" else f"{report.outcome.upper()} in {report.when}"
    line = f"[{time.monotonic() - _T0:8.1f} s] {outcome} {report.duration:.2f} s {report.nodeid}"
    if report.failed:
        line += f" -- {_reason(report)}"
    with open(path, "a") as f:
        f.write(line + "\n")
