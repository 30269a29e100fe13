"""The GPU tests (``pytest -m gpu``) in parts that each fit a bounded run, the same selection every time.

    python scripts/gpu_suite.py --parts 2 --part 1 [--kernel-cache fi-cache] [--all] [-- PYTEST_ARGS...]
    python scripts/gpu_suite.py --parts 2 --list      # the test ids of each part, running nothing

The selection is the one the results pages run as "the GPU suite": every test marked ``gpu`` under ``tests/``
but the server's (``tests/server``, which start engine processes of their own), the block-FP8 model tests
(``tests/models/test_gpu_fp8.py``, whose FlashInfer FP8 modules a bf16 kernel cache does not hold, so they
compile on first use) and the FlashInfer CUTLASS MoE cases (``-k "not cutlass"``, a module of many minutes to
compile); ``--all`` keeps all of them. The collected ids (collected on the machine that runs them: a module
whose imports are missing is skipped at collection) are cut into ``--parts`` consecutive runs of about the same
number of tests; a part runs with ``--durations=15`` so that its slowest tests are named.
With ``--kernel-cache DIR`` the tests' engines load their kernels from that cache (``MOESERVE_KERNEL_CACHE``).
With ``--live-log FILE`` each test's outcome and seconds (and a failure's reason) are appended to FILE as it ends
(``scripts/pytest_live_log.py``), so that a run stopped by a time limit before pytest's summary still names them.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LEFT_OUT = ["tests/server", "tests/models/test_gpu_fp8.py"]


def collect(all_tests: bool) -> list[str]:
    """The node ids ``pytest -m gpu`` selects (with the default exclusions unless ``all_tests``), in order."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"]
    if not all_tests:
        cmd += [f"--ignore={p}" for p in LEFT_OUT] + ["-k", "not cutlass"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if out.returncode not in (0, 5) or not ids:  # 5: nothing collected
        raise SystemExit(f"gpu_suite: collecting the GPU tests failed (pytest exit {out.returncode}):\n"
                         + (out.stdout + out.stderr)[-2000:])
    return ids


def split(ids: list[str], parts: int) -> list[list[str]]:
    """``ids`` cut into ``parts`` consecutive runs of (nearly) equal length; every id lands in exactly one."""
    n = len(ids)
    return [ids[k * n // parts:(k + 1) * n // parts] for k in range(parts)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python scripts/gpu_suite.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", type=int, default=1, help="how many runs the suite is cut into (default 1)")
    p.add_argument("--part", type=int, default=1, help="which of them to run, from 1 (default 1)")
    p.add_argument("--list", action="store_true", help="print each part's test ids and run nothing")
    p.add_argument("--all", action="store_true", help="also the server, block-FP8 and CUTLASS MoE tests")
    p.add_argument("--kernel-cache", help="run the tests' engines on this kernel cache (MOESERVE_KERNEL_CACHE)")
    p.add_argument("--live-log", help="append each test's outcome, seconds and a failure's reason to this file as "
                   "it ends")
    args = p.parse_args(argv)
    if args.parts < 1 or not 1 <= args.part <= args.parts:
        p.error(f"--part must be between 1 and --parts ({args.parts}), got {args.part}")
    chunks = split(collect(args.all), args.parts)
    if args.list:
        for n, chunk in enumerate(chunks, 1):
            print(f"# part {n}/{args.parts}: {len(chunk)} tests")
            print("\n".join(chunk))
        return 0
    chunk = chunks[args.part - 1]
    if not chunk:
        print(f"gpu_suite: part {args.part}/{args.parts} holds no tests")
        return 0
    env = dict(os.environ)
    if args.kernel_cache:
        env["MOESERVE_KERNEL_CACHE"] = str(Path(args.kernel_cache).resolve())
    print(f"gpu_suite: part {args.part}/{args.parts}: {len(chunk)} tests in "
          f"{len({c.split('::', 1)[0] for c in chunk})} files", flush=True)
    live = []
    if args.live_log:
        env["MOESERVE_LIVE_LOG"] = str(Path(args.live_log).resolve())
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "scripts"), env.get("PYTHONPATH")]))
        live = ["-p", "pytest_live_log"]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *live, "-q", "-rfE",
           "--durations=15", *extra, *chunk]
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
