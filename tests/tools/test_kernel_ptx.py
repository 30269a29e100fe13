"""``scripts/kernel_ptx.py``: the PTX of every Triton kernel the GPU benchmark's configuration launches, compiled
for sm90 on this machine without line info, and the comparison of two dumps."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_utils import cli_env, load_script

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]


def test_compare_names_the_launches_that_differ_or_are_missing(tmp_path, capsys):
    compare = load_script("kernel_ptx").compare
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for d in (a, b):
        (d / "k1-0.ptx").write_text("same")
    (a / "k2-0.ptx").write_text("mov.u32 %r1, 0;")
    (b / "k2-0.ptx").write_text("mov.u32 %r1, 1;")
    (a / "k3-0.ptx").write_text("only here")
    assert compare(a, a) == 0
    assert compare(a, b) == 1
    out = capsys.readouterr().out
    assert "differs: k2-0.ptx" in out and f"only in {a}: k3-0.ptx" in out
    assert "1 equal, 1 differ, 1 in one only" in out


def test_the_benchmark_configs_kernels_dump_without_line_info_for_sm90(tmp_path):
    """One file per launch (the routed grid and the fused MoE among them), each sm90a PTX with no ``.loc`` line:
    two checkouts differing only in line numbers dump the same files. A dump compared with a copy of itself in
    which one kernel's PTX changed names that kernel."""
    out = tmp_path / "ptx"
    proc = subprocess.run([sys.executable, "scripts/kernel_ptx.py", "--config", "moeserve/presets/bench-gpu.yaml",
                           "--out", str(out)], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(out.glob("*.ptx"))
    assert f"{len(files)} kernels' PTX" in proc.stdout
    names = {f.name.rsplit("-", 1)[0] for f in files}
    assert {"_route_moe_kernel", "fused_moe_kernel", "moe_combine_kernel"} <= names
    assert sum(f.name.startswith("fused_moe_kernel-") for f in files) > 1  # one file per launch, not per name
    for f in files:
        text = f.read_text()
        assert ".target sm_90a" in text and "\t.loc" not in text, f.name
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    changed = next(f for f in copy.glob("moe_combine_kernel-*.ptx"))
    changed.write_text(changed.read_text().replace("add.f32", "sub.f32", 1))
    cmp = subprocess.run([sys.executable, "scripts/kernel_ptx.py", "--compare", str(out), str(copy)], cwd=REPO,
                         env=cli_env(), capture_output=True, text=True, timeout=120)
    assert cmp.returncode == 1 and f"differs: {changed.name}" in cmp.stdout, cmp.stdout
