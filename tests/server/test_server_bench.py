"""``moeserve bench online`` against the real test server: a result file in the shared schema with
positive, finite latency figures, for both engine names."""
import argparse
import json
import math
from pathlib import Path

import pytest

from moeserve.bench import online
from moeserve.server.cli import BackgroundServer, build_server
from test_server import tiny_config
from tokenizer_utils import make_tiny_model

LATENCIES = [f"{m}_{s}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny_bench"))
    with BackgroundServer(build_server(tiny_config(model_dir))) as srv:
        yield srv.url


def run_bench(url, out: Path, *extra) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    online.add_args(parser)
    args = parser.parse_args(["--url", url, "--input-len", "8", "--output-len", "4", "--num-prompts", "6",
                              "--max-concurrency", "1", "3", "--num-warmups", "1", "--out", str(out), *extra])
    rc = online.run(args)
    files = sorted(out.glob("*.json"))
    assert len(files) == 1
    return rc, json.loads(files[0].read_text())


def test_bench_online_writes_positive_finite_latencies(server_url, tmp_path):
    rc, result = run_bench(server_url, tmp_path)
    assert rc == 0
    assert result["kind"] == "online" and result["model"]["name"] == "tiny-moe"
    assert result["config"]["max_model_len"] == 128, "the config comes from the server"
    [engine] = result["engines"]
    assert engine["name"] == "moeserve" and engine["available"] and engine["backends"]["moe"] == "torch"
    assert [r["concurrency"] for r in engine["results"]] == [1, 3]
    for row in engine["results"]:
        assert row["completed"] == 6 and row["failed"] == 0
        assert (row["prompt_len"], row["output_len"]) == (8, 4)
        assert row["total_output_tokens"] == 24 and row["total_input_tokens"] == 48
        for key in LATENCIES + ["request_throughput", "output_tok_s", "total_tok_s"]:
            assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, key
        assert row["ttft_median_ms"] <= row["e2el_median_ms"]
        assert 1 <= row["max_concurrent_requests"] <= row["concurrency"]
        assert len(row["runs"][0]["requests"]) == 6


def test_bench_online_as_vllm_with_a_label_and_poisson_arrivals(server_url, tmp_path):
    rc, result = run_bench(server_url, tmp_path, "--backend-name", "vllm", "--label", "vllm-fi",
                           "--request-rate", "50", "--model", "tiny-moe")
    assert rc == 0
    [engine] = result["engines"]
    assert (engine["name"], engine["label"]) == ("vllm", "vllm-fi")
    assert engine["backends"] == {} and engine["start_seconds"] is None, "nothing is read from vLLM's server"
    assert all(r["completed"] == 6 and r["request_rate"] == 50.0 for r in engine["results"])


def test_bench_online_reports_failures(server_url, tmp_path):
    rc, result = run_bench(server_url, tmp_path, "--model", "not-served", "--num-warmups", "0")
    assert rc == 1
    [engine] = result["engines"]
    assert not engine["available"]
    row = engine["results"][0]
    assert row["completed"] == 0 and row["failed"] == 6 and row["ttft_mean_ms"] is None
    assert "model_not_found" in row["runs"][0]["errors"][0]


def test_bench_serving_compares_offline_and_online_in_one_run(tmp_path):
    """``moeserve bench serving`` on the tiny model: offline engine, then ``moeserve serve`` on the same
    config; every request of both completes and the comparison has finite TTFT/ITL at each level."""
    from moeserve.bench import serving_overhead
    model_dir = make_tiny_model(tmp_path / "tiny")
    parser = argparse.ArgumentParser()
    serving_overhead.add_args(parser)
    args = parser.parse_args(["--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
                              "--max-model-len", "128", "--num-kv-pages", "200", "--page-size", "8",
                              "--enforce-eager", "--input-len", "16", "--output-len", "4",
                              "--max-concurrency", "1", "2", "--num-prompts", "4", "--num-warmups", "1",
                              "--out", str(tmp_path / "out")])
    assert serving_overhead.run(args) == 0
    [path] = (tmp_path / "out").glob("serving-overhead-*.json")
    result = json.loads(path.read_text())
    assert [r["concurrency"] for r in result["comparison"]] == [1, 2]
    for side in ("offline", "online"):
        for row in result[side]:
            assert row["completed"] == 4 and row["failed"] == 0 and row["total_output_tokens"] == 16
    for row in result["comparison"]:
        for key in ("offline_ttft_ms", "online_ttft_ms", "offline_itl_ms", "online_itl_ms", "itl_ratio"):
            assert math.isfinite(row[key]) and row[key] > 0, key
        assert math.isfinite(row["added_ttft_ms"])
        # the server's own split of its time to first token, as means over the level's 4 requests
        assert row["queue_ms"] >= 0 and row["prefill_ms"] > 0 and row["handoff_ms"] >= 0, row
