"""``scripts/gpu_suite.py``: the GPU tests cut into parts, each test in exactly one part, with the results pages'
selection (no server, block-FP8 model or CUTLASS MoE tests unless ``--all``)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
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
