"""``moeserve bench`` end to end on the tiny model (CPU), ``bench kernels`` on CPU, and ``moeserve compare``."""
import json
import math

import pytest

from moeserve.cli import main

TINY = ["--model", "tiny", "--set", "bench.prompt_len=16", "--set", "bench.output_len=8",
        "--set", "bench.concurrency=[1, 2]", "--set", "bench.runs=1", "--set", "bench.warmup_runs=0"]


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert main(["bench", *TINY, "--output-dir", str(out)]) == 0
    return out


def _result(out):
    return json.loads((out / "result.json").read_text())


def test_result_has_the_schema(bench_dir):
    r = _result(bench_dir)
    assert r["kind"] == "offline"
    for key in ("created", "command", "moeserve_version", "environment", "config", "model", "engines", "roofline"):
        assert key in r, key
    assert r["model"] == {"name": "tiny", "model_type": "qwen3_moe", "dtype": "float32"}
    assert r["config"]["bench"]["prompt_len"] == 16
    for e in r["engines"]:
        assert {"name", "label", "available", "reason", "backends", "start_seconds", "memory", "results"} <= set(e)


def test_moeserve_rows_are_positive_and_finite(bench_dir):
    ours = _result(bench_dir)["engines"][0]
    assert ours["name"] == "moeserve" and ours["available"] and ours["start_seconds"] > 0
    assert ours["backends"]["attention"] == "torch"
    assert {"weights_bytes", "kv_cache_bytes", "activation_peak_bytes"} <= set(ours["memory"])
    rows = {(x["workload"], x["concurrency"]): x for x in ours["results"]}
    assert set(rows) == {(w, c) for w in ("prefill", "decode", "mixed") for c in (1, 2)}
    for row in rows.values():
        metrics = {k: v for k, v in row.items() if k.endswith(("_s", "_tok_s", "throughput", "fraction"))}
        assert metrics and all(math.isfinite(v) and v > 0 for v in metrics.values()), row["workload"]
        assert len(row["runs"]) == 1
    assert {"ttft_s", "prefill_tok_s"} <= set(rows[("prefill", 2)])
    assert {"total_tok_s", "output_tok_s", "ttft_s"} <= set(rows[("mixed", 2)])
    assert 0 < rows[("decode", 2)]["roofline_fraction"]
    assert 1 / 2 <= rows[("decode", 2)]["distinct_token_frac"] <= 1


def test_decode_tok_s_matches_its_definition_from_raw_timings(bench_dir):
    ours = _result(bench_dir)["engines"][0]
    row = next(x for x in ours["results"] if x["workload"] == "decode" and x["concurrency"] == 2)
    reqs = row["runs"][0]["requests"]
    assert len(reqs) == 2 and all(q["num_tokens"] == 8 for q in reqs)
    t_1 = max(q["first_token_s"] for q in reqs)
    t_n = max(q["nth_token_s"] for q in reqs)
    assert row["decode_tok_s"] == pytest.approx(2 * 7 / (t_n - t_1))
    assert row["ttft_s"] == pytest.approx(t_1)


def test_vllm_entries_say_why_they_are_unavailable(bench_dir):
    vllm = [e for e in _result(bench_dir)["engines"] if e["name"] == "vllm"]
    assert [e["label"] for e in vllm] == ["vllm:default", "vllm:flashinfer"]
    for e in vllm:
        assert e["available"] is False and e["reason"] and e["results"] == []


def test_table_markdown_and_plots_are_written(bench_dir):
    for name in ("result.md", "result.txt", "result-throughput.png", "result-ttft.png"):
        assert (bench_dir / name).stat().st_size > 0, name
    md = (bench_dir / "result.md").read_text()
    assert "decode_tok_s" in md and "vllm:default (unavailable)" in md
    assert not (bench_dir / "result.partial.json").exists()


def test_compare_prints_ratios(bench_dir, tmp_path, capsys):
    a = _result(bench_dir)
    b = json.loads(json.dumps(a))
    row = next(x for x in b["engines"][0]["results"] if x["workload"] == "decode" and x["concurrency"] == 1)
    row["decode_tok_s"] = 2 * next(x for x in a["engines"][0]["results"]
                                   if x["workload"] == "decode" and x["concurrency"] == 1)["decode_tok_s"]
    (tmp_path / "b.json").write_text(json.dumps(b))
    capsys.readouterr()
    assert main(["compare", str(bench_dir / "result.json"), str(tmp_path / "b.json"),
                 "--metric", "decode_tok_s", "--width", "160"]) == 0
    out = capsys.readouterr().out
    assert "2.000x" in out and "1.000x" in out and "ttft" not in out
    assert "vllm:default unavailable" in out


def test_compare_refuses_a_file_that_is_not_a_result(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{}")
    assert main(["compare", str(tmp_path / "x.json"), str(tmp_path / "x.json")]) == 2
    assert "not a moeserve benchmark result" in capsys.readouterr().err


def test_merge_adds_engines_of_an_earlier_result(bench_dir, tmp_path):
    out = tmp_path / "merged"
    assert main(["bench", *TINY, "--only", "vllm", "--vllm-config", "default", "--merge",
                 str(bench_dir / "result.json"), "--output-dir", str(out)]) == 0
    r = _result(out)
    assert [e["label"] for e in r["engines"]] == ["vllm:default", "moeserve", "vllm:default (result)",
                                                  "vllm:flashinfer"]
    merged = r["engines"][1]
    assert merged["results"] and any("merged from" in n for n in merged["notes"])


def test_merge_joins_one_engine_measured_on_other_workloads(bench_dir, tmp_path):
    whole = json.loads((bench_dir / "result.json").read_text())
    ours = next(e for e in whole["engines"] if e["label"] == "moeserve")
    assert len({r["workload"] for r in ours["results"]}) > 1
    parts = []
    for i, keep in enumerate((lambda w: w == "decode", lambda w: w != "decode")):
        part = json.loads(json.dumps(whole))
        part["engines"] = [dict(ours, results=[r for r in ours["results"] if keep(r["workload"])])]
        (tmp_path / f"p{i}.json").write_text(json.dumps(part))
        parts += ["--merge", str(tmp_path / f"p{i}.json")]
    out = tmp_path / "joined"
    assert main(["bench", *TINY, "--only", "vllm", "--vllm-config", "default", *parts, "--output-dir", str(out)]) == 0
    engines = _result(out)["engines"]
    assert [e["label"] for e in engines] == ["vllm:default", "moeserve"]
    joined = engines[1]
    key = lambda r: (r["workload"], r.get("concurrency"))  # noqa: E731
    assert sorted(map(key, joined["results"])) == sorted(map(key, ours["results"]))
    assert sum("merged from" in n for n in joined["notes"]) >= 2


def test_bench_kernels_on_cpu_lists_every_kernel_as_skipped(tmp_path, capsys):
    assert main(["bench", "kernels", "--model", "tiny", "--output-dir", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "kernels.json").read_text())
    assert r["kind"] == "kernels" and r["kernels"]
    assert all(k["status"] == "skipped" and "CUDA GPU" in k["reason"] for k in r["kernels"])
    names = {k["kernel"] for k in r["kernels"]}
    assert {"flashinfer decode (CUDA cores)", "flashinfer prefill fa3", "trtllm xqa decode",
            "flashinfer cutlass_fused_moe", "moeserve triton fused_moe", "flashinfer mixed: batched POD (fa2)",
            "flashinfer mixed: one prefill plan (fa3)"} <= names
    assert "skipped: needs a CUDA GPU" in capsys.readouterr().out


def test_bench_kernels_refuses_a_bad_kernels_pattern(tmp_path, capsys):
    assert main(["bench", "kernels", "--model", "tiny", "--kernels", "mixed(", "--output-dir", str(tmp_path)]) == 2
    assert "--kernels 'mixed(' is not a regular expression" in capsys.readouterr().err
    assert not (tmp_path / "kernels.json").exists()


def test_unknown_bench_flag_values_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--only", "sglang"])
    assert "invalid choice" in capsys.readouterr().err
