"""``scripts/gpu_suite.py``: the GPU tests cut into parts, each test in exactly one part, with the results pages'
selection (no server, block-FP8 model or CUTLASS MoE tests unless ``--all``)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_utils import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_suite.py"


@pytest.mark.parametrize("n, parts", [(0, 2), (1, 3), (7, 2), (199, 2), (250, 3), (5, 5)])
def test_parts_partition_the_ids_in_order(n, parts):
    ids = [f"tests/t{i // 4}.py::test_{i}" for i in range(n)]
    chunks = load_script("gpu_suite").split(ids, parts)
    assert len(chunks) == parts
    assert [i for c in chunks for i in c] == ids  # every id once, in order
    assert max(map(len, chunks)) - min(map(len, chunks)) <= 1


def _listed(*args) -> dict[int, list[str]]:
    out = subprocess.run([sys.executable, str(SCRIPT), "--list", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    parts, cur = {}, None
    for line in out.stdout.splitlines():
        if line.startswith("# part "):
            cur = int(line.split()[2].split("/")[0])
            parts[cur] = []
        elif line.strip():
            parts[cur].append(line)
    return parts


def test_the_listed_parts_hold_the_selection_once():
    parts = _listed("--parts", "3")
    assert sorted(parts) == [1, 2, 3]
    ids = [i for p in parts.values() for i in p]
    assert ids and len(ids) == len(set(ids))
    assert all("::" in i and i.startswith("tests/") for i in ids)
    assert not any(i.startswith(("tests/server", "tests/models/test_gpu_fp8.py")) or "cutlass" in i for i in ids)
    assert any(i.startswith("tests/models/test_gpu_model.py::") for i in ids)  # whole-model GPU tests are in it
    everything = [i for p in _listed("--all").values() for i in p]
    assert set(ids) < set(everything)
    # the whole-model case on FlashInfer's CUTLASS MoE (a module of many minutes to compile) only with --all
    cutlass_case = "tests/models/test_gpu_model.py::test_fast_path_matches_torch_path[qwen3_moe-flashinfer_cutlass]"
    assert cutlass_case in everything and cutlass_case not in ids


def test_a_part_outside_the_range_is_one_clear_line():
    out = subprocess.run([sys.executable, str(SCRIPT), "--parts", "2", "--part", "3"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--part must be between 1 and --parts (2), got 3" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_live_log_names_each_test_as_it_ends(tmp_path):
    """``scripts/pytest_live_log.py``: a line per test when it ends, a failure's with its assertion, a skip and an
    error in set-up with where they happened; nothing for set-up and tear-down that passed."""
    (tmp_path / "test_cases.py").write_text(
        "import pytest\n"
        "@pytest.fixture\n"
        "def broken():\n"
        "    raise RuntimeError('fixture broke')\n"
        "def test_passes():\n"
        "    assert True\n"
        "def test_fails():\n"
        "    assert 1 + 1 == 3, 'arithmetic is off'\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped():\n"
        "    pass\n"
        "def test_errors(broken):\n"
        "    pass\n")
    log = tmp_path / "live.log"
    env = {**os.environ, "MOESERVE_LIVE_LOG": str(log), "PYTHONPATH": str(REPO / "scripts")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_live_log",
                          str(tmp_path / "test_cases.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stdout[-2000:]
    lines = log.read_text().splitlines()
    assert len(lines) == 4, lines
    assert all(re.match(r"\[ *\d+\.\d s\] [A-Z]+", ln) for ln in lines), lines
    assert " PASSED " in lines[0] and lines[0].endswith("test_cases.py::test_passes")
    assert " FAILED " in lines[1] and "test_fails -- AssertionError: arithmetic is off" in lines[1]
    assert " SKIPPED in setup " in lines[2] and lines[2].endswith("::test_skipped")
    assert " FAILED in setup " in lines[3] and "test_errors -- RuntimeError: fixture broke" in lines[3]


def test_the_suite_passes_the_live_log_to_pytest(tmp_path):
    """``--live-log``: the suite's pytest writes the file, a line for each test of the part (here, without a GPU,
    every one skipped at set-up)."""
    log = tmp_path / "live.log"
    listed = _listed("--parts", "40")[1]
    out = subprocess.run([sys.executable, str(SCRIPT), "--parts", "40", "--part", "1", "--live-log", str(log)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = log.read_text().splitlines()
    assert [ln.rsplit(" ", 1)[-1] for ln in lines] == listed, out.stdout[-2000:]
    if not torch.cuda.is_available():
        assert out.returncode == 0 and all(" SKIPPED in setup " in ln for ln in lines)
