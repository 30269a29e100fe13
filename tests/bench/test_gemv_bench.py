"""``python -m moeserve.bench.gemv``: the dense linears timed as a decode step runs them (one CUDA graph of
back-to-back calls, each on its own copy of the weight, so every call reads it from HBM)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeserve.bench.gemv import copies_for

REPO = Path(__file__).resolve().parents[2]


def test_enough_weight_copies_to_pass_three_l2_caches():
    l2 = 50 * 2 ** 20
    assert copies_for(8 * 2 ** 20, l2) == 19  # 2048 x 2048 bf16: 19 x 8 MiB >= 150 MiB
    assert copies_for(622 * 2 ** 20, l2) == 4  # an LM head: the floor of four
    assert copies_for(32 * 2 ** 10, l2) == 1024  # a 128 x 128 weight: capped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_bench_checks_and_times_every_linear_of_a_model(tmp_path):
    out = tmp_path / "gemv.json"
    run = subprocess.run([sys.executable, "-m", "moeserve.bench.gemv", "--model", "tiny", "--rows", "1", "3",
                          "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["rows"] and {r["rows"] for r in doc["rows"]} == {1, 3}
    for r in doc["rows"]:  # within the tolerance the bench checks itself, timed over several weight copies
        assert r["rel_err"] < 2e-2 and r["cublas_us"] > 0 and r["gemv_us"] > 0, r
        assert 4 <= r["copies"] <= 1024, r
