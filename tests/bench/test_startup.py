"""``moeserve bench startup`` on the CPU: a fresh worker process per start, the first request's TTFT at each
concurrency beside the steady state, and the kernel compile counts (FlashInfer modules, Triton kernels)."""
import json

from moeserve.cli import main


def test_startup_reports_first_request_ttft_per_concurrency_and_compile_counts(tmp_path):
    code = main(["bench", "startup", "--model", "tiny", "--device", "cpu", "--modes", "cold", "--skip-vllm",
                 "--concurrency", "1,4", "--prompt-len", "8", "--output-dir", str(tmp_path)])
    assert code == 0
    entry = json.loads((tmp_path / "startup.json").read_text())["engines"][0]
    assert entry["available"] and entry["mode"] == "cold"
    rows = entry["results"]
    assert rows[0]["workload"] == "startup" and rows[0]["ready_s"] > 0 and rows[0]["first_token_s"] >= rows[0]["ready_s"]
    probes = {r["concurrency"]: r for r in rows if r["workload"] == "first-request"}
    assert set(probes) == {1, 4}
    for r in probes.values():
        assert r["ttft_s"] > 0 and r["steady_ttft_s"] > 0 and r["first_over_steady"] > 0
    assert entry["triton"]["summary"].startswith("Triton: ") and entry["triton"]["compiled"] == []
    assert rows[0]["triton_kernels_compiled"] == 0  # the CPU runs no Triton kernel
