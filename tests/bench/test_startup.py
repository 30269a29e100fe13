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
    phases = entry["startup"]["startup_phases"]
    assert list(phases)[:2] == ["plan", "cuda_init"] and {"weights", "build_model", "kv_cache", "tokenizer"} <= set(phases)
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= rows[0]["ready_s"]
    assert rows[0]["weights_s"] == phases["weights"]
    assert abs(rows[0]["ready_minus_weights_s"] - (rows[0]["ready_s"] - phases["weights"])) < 1e-3


def test_vllm_start_up_figures_are_read_from_its_log():
    from moeserve.bench.startup import vllm_startup_figures
    log = ("INFO 12-01 [gpu_model_runner.py:2602] Model loading took 26.7093 GiB memory and 8.974661 seconds\n"
           "INFO 12-01 [backends.py:215] torch.compile takes 21.43 s in total\n"
           "INFO 12-01 [gpu_model_runner.py:3480] Graph capturing finished in 21 secs, took 0.61 GiB\n")
    assert vllm_startup_figures(log) == {"model_load_seconds": 8.974661, "torch_compile_seconds": 21.43,
                                         "graph_capture_seconds": 21.0}
    assert vllm_startup_figures("nothing") == {}
