"""``scripts/ab_arms.py``: arm specs, the table against the first arm, and a run of two arms on the CPU's tiny model
(one of them refused by the config, which costs that arm only)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_utils import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "ab_arms.py"


def test_arm_specs():
    parse = load_script("ab_arms").parse_arm
    assert parse("base") == ("base", None, [])
    assert parse("g4:linear_gemv_max_tokens=4,pdl_max_tokens=0") == ("g4", None, ["linear_gemv_max_tokens=4",
                                                                                   "pdl_max_tokens=0"])
    assert parse("old@a:x=1") == ("old", "a", ["x=1"])
    with pytest.raises(ValueError, match="is not key=value"):
        parse("b:oops")


def test_constants_read_back_typed_where_json_holds_them():
    plain = load_script("decode_ab").plain
    assert [plain(v) for v in (16384, False, 0.5, "x", [1, 2])] == [16384, False, 0.5, "x", [1, 2]]
    assert plain({1, 2}) == "{1, 2}" and plain(float("nan")) == "nan"


def test_the_table_compares_every_arm_with_the_first():
    rows = [{"arm": "a", "rows": [{"concurrency": 1, "decode_tok_s": 100.0}]},
            {"arm": "b", "rows": [{"concurrency": 1, "decode_tok_s": 110.0}]},
            {"arm": "a", "rows": [{"concurrency": 1, "decode_tok_s": 100.0}]},
            {"arm": "b", "rows": [{"concurrency": 1, "decode_tok_s": 120.0}]}]
    text = load_script("ab_arms").table(rows, "a")
    assert "115.0 (+15.0%)" in text and text.splitlines()[1].split()[:2] == ["a", "100.0"]


def test_two_arms_on_the_tiny_model(tmp_path):
    out = tmp_path / "ab.jsonl"
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--set", "max_model_len=2048",
                          "--arm", "base", "--arm", "nopdl:pdl_max_tokens=0", "--arm", "bad:no_such_option=1",
                          "--concurrency", "1", "--rounds", "1", "--runs", "1", "--prompt-len", "32",
                          "--output-len", "8", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "bad round 1: exit 1: decode_ab: config error: no_such_option: unknown field" in run.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["arm"] for r in rows] == ["base", "nopdl"] and rows[1]["sets"] == ["pdl_max_tokens=0"]
    assert all(r["rows"][0]["decode_tok_s"] > 0 for r in rows)
    assert "nopdl" in run.stdout.splitlines()[-1]


def test_an_arm_sets_a_module_constant_without_a_copy_of_the_tree(tmp_path):
    """``py.MODULE.NAME=VALUE`` in an arm's options sets that moeserve constant in the arm's process (read back in
    its JSON line), not in the other arms'; a name the module lacks fails that arm alone, in one line."""
    out = tmp_path / "ab.jsonl"
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--set", "max_model_len=2048",
                          "--arm", "base", "--arm", "wide:py.moeserve.ops.linear_triton.GEMV_MAX_N=1000000",
                          "--arm", "typo:py.moeserve.ops.linear_triton.GEMV_MAX_M=1",
                          "--arm", "other:py.os.sep=x",
                          "--concurrency", "1", "--rounds", "1", "--runs", "1", "--prompt-len", "32",
                          "--output-len", "8", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["arm"] for r in rows] == ["base", "wide"]
    assert "constants" not in rows[0]
    assert rows[1]["constants"] == {"moeserve.ops.linear_triton.GEMV_MAX_N": 1000000}  # typed, as the arm set it
    assert ("typo round 1: exit 1: decode_ab: --set py.moeserve.ops.linear_triton.GEMV_MAX_M=1: "
            "'moeserve.ops.linear_triton' has no constant 'GEMV_MAX_M'") in run.stdout
    assert "other round 1: exit 1: decode_ab: --set py.os.sep=x: only moeserve's modules take constants" in run.stdout
