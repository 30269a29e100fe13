"""``scripts/decode_ab.py``, the A/B instrument of the results pages: it must time decode as the benchmark does
(from every request's first token to its last, within one run), so a prefill that varies between processes
stays out of the decode rate."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_decode_ab_reports_the_benchmarks_decode_rate_per_run():
    out = subprocess.run([sys.executable, "scripts/decode_ab.py", "--model", "tiny", "--set", "dtype=float32",
                          "--set", "device=cpu", "--set", "max_model_len=128", "--set", "max_num_batched_tokens=256",
                          "--prompt-len", "8", "--output-len", "6", "--concurrency", "1", "3", "--runs", "3",
                          "--label", "tiny"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["label"] == "tiny" and [r["concurrency"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        rates, ttfts, e2es = row["decode_runs_tok_s"], row["ttft_runs_s"], row["e2e_runs_s"]
        assert len(rates) == len(ttfts) == len(e2es) == 3
        assert abs(row["decode_tok_s"] - statistics.median(rates)) <= 0.1
        for rate, ttft, e2e in zip(rates, ttfts, e2es):
            # each request's 5 tokens after its first, timed from the last first token to the last token
            assert 0 < ttft < e2e
            assert abs(row["concurrency"] * 5 / rate - (e2e - ttft)) <= 2e-4 + 1e-3 * (e2e - ttft)
