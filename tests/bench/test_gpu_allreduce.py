"""FlashInfer's custom all-reduce and its all-reduce + residual + RMSNorm fusion against NCCL at decode sizes
(2 GPUs): every fused result equals NCCL's sum followed by the engine's add + RMSNorm within bf16 tolerance
(0.05 absolute on values of order 1), and each timing is a positive number."""
import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def test_allreduce_benchmark(tmp_path):
    from moeserve.bench.allreduce import main
    out = tmp_path / "allreduce.json"
    assert main(["--tp", "2", "--hidden", "2048", "--tokens", "1", "8", "64", "--iters", "5", "--ops-per-graph", "5",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["tokens"] for r in res["rows"]] == [1, 8, 64]
    for r in res["rows"]:
        assert r["correct"], r
        assert all(r[k] > 0 for k in r if k.endswith("_us"))
