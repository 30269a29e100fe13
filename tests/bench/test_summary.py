"""summary.json and the README table come from a benchmark result, not from hand-written numbers."""
import json

import pytest

from moeserve.bench.summary import END, START, main, markdown_table, replace_block, summarize


def result():
    row = lambda c, tok, ttft, frac: {"workload": "decode", "concurrency": c, "decode_tok_s": tok,  # noqa: E731
                                      "ttft_s": ttft, "roofline_fraction": frac, "runs": []}
    return {
        "kind": "offline", "created": "2026-11-30T12:00:00+00:00", "commit": "abc1234", "command": "moeserve bench",
        "weights": "shared-checkpoint", "roofline": {"bandwidth_bytes_per_s": 4.0867e12},
        "environment": {"gpus": [{"name": "NVIDIA H200"}], "driver_version": "580",
                        "versions": {"torch": "2.11.0", "triton": "3.6.0", "flashinfer": "0.6.14"}},
        "config": {"bench": {"prompt_len": 512, "output_len": 128, "runs": 3}},
        "model": {"name": "qwen1.5-moe-a2.7b", "model_type": "qwen2_moe", "dtype": "bfloat16"},
        "engines": [
            {"name": "moeserve", "label": "moeserve", "available": True, "results": [row(1, 400.0, 0.02, 0.5),
                                                                                     row(8, 1800.0, 0.04, 0.8)]},
            {"name": "vllm", "label": "vllm:default", "available": True, "versions": {"vllm": "0.26.0"},
             "results": [row(1, 413.0, 0.03, 0.52), row(8, 1672.0, 0.05, 0.74)]},
            {"name": "vllm", "label": "vllm:flashinfer", "available": False, "results": []},
        ],
    }


def test_summary_carries_the_provenance_and_every_cell():
    s = summarize(result(), "docs/results/x")
    assert s["gpu"] == "NVIDIA H200" and s["commit"] == "abc1234" and s["weights"] == "shared-checkpoint"
    assert s["versions"]["vllm"] == "0.26.0" and s["date"] == "2026-11-30"
    assert [e["engine"] for e in s["engines"]] == ["moeserve", "vllm:default"]
    assert s["workloads"]["decode"]["8"]["vllm:default"]["decode_tok_s"] == 1672.0
    table = markdown_table(s)
    assert "| 1 | 400 | 413 | 0.97 | 20.0 | 30.0 | 50.0% | 52.0% |" in table
    assert "| 8 | 1,800 | 1,672 | 1.08 |" in table and "weights: shared-checkpoint" in table
    assert "| 80.0% | 74.0% |" in table  # one decimal: 89.6% must not read as 90%
    # the fractions' denominator is named: it differs between GPUs of one kind
    assert s["copy_bandwidth_gb_s"] == 4086.7 and "copy bandwidth measured in the run, 4,087 GB/s" in table
    full = {**result(), "commit": "85ac4162cfd2406c1575c294b8306beeb83c9eeb"}  # a full hash: kept, captioned short
    assert summarize(full)["commit"] == full["commit"] and "commit `85ac416`;" in markdown_table(summarize(full))
    assert "commit `abc1234`;" in table
    without = result()
    del without["roofline"]
    assert summarize(without)["copy_bandwidth_gb_s"] is None and "GB/s" not in markdown_table(summarize(without))


def test_the_readme_block_is_replaced_and_nothing_else(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nbefore\n{START}\nold table\n{END}\nafter\n")
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result()))
    assert main([str(path), "--out", str(tmp_path / "summary.json"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# x\nbefore\n") and text.endswith(f"{END}\nafter\n")
    assert "| 8 | 1,800 |" in text
    assert json.loads((tmp_path / "summary.json").read_text())["weights"] == "shared-checkpoint"
    with pytest.raises(ValueError, match="results-table"):
        replace_block("no markers", "x")


def test_the_committed_readme_table_is_the_committed_summary():
    """The README's results table is what docs/results/summary.json renders to, and the summary is what its
    results page's result file summarises: no figure in the table was typed by hand."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    summary = json.loads((root / "docs/results/summary.json").read_text())
    readme = (root / "README.md").read_text()
    block = readme.split(START, 1)[1].split(END, 1)[0].strip()
    assert block == markdown_table(summary).strip()
    results = [json.loads(f.read_text()) for f in (root / summary["results_dir"]).rglob("result.json")]
    assert any(summarize(r, summary["results_dir"]) == summary for r in results)
