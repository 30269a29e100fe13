"""The step profiler's timeline: what runs on the critical path, what waits, what overlaps (synthetic traces)."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeserve.bench.step_profile import kernels_from_trace, timeline


def _kernel(name, stream, ts, dur, grid=(1, 1, 1)):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "grid": list(grid)}}


def test_timeline_splits_a_step_into_running_waiting_and_overlapped_time():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},  # host events are not kernels
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 1},
        _kernel("gemv", 7, 0, 10),
        _kernel("norm", 7, 12, 8),              # waited 2 us for its launch
        _kernel("shared_mlp", 13, 13, 12),      # the side stream, beside the main one
        _kernel("moe", 7, 19, 11, grid=(4, 2, 1)),  # started 1 us before "norm" ended (PDL)
        # a second step: the same kernels, one gap of 20 us between the steps (the host)
        _kernel("gemv", 7, 50, 10),
        _kernel("norm", 7, 62, 8),
        _kernel("shared_mlp", 13, 63, 12),
        _kernel("moe", 7, 69, 11, grid=(4, 2, 1)),
    ]}
    ks = kernels_from_trace(trace)
    assert [k[0] for k in ks] == ["gemv", "norm", "shared_mlp", "moe"] * 2
    t = timeline(ks, steps=2)
    assert t["window_us_per_step"] == pytest.approx(40.0)
    assert t["gpu_busy_us_per_step"] == pytest.approx(28.0)
    assert t["gpu_idle_us_per_step"] == pytest.approx(12.0)
    assert t["streams"] == 2
    # two or more kernels at once: 13-19 norm and shared_mlp, 19-20 all three, 20-25 shared_mlp and moe
    assert t["overlapped_us_per_step"] == pytest.approx(12.0)
    gaps = {b["gap"]: (b["per_step"], b["us_per_step"]) for b in t["idle_gaps"]}
    assert gaps["1-3 us"] == (1.0, 2.0) and gaps[">= 10 us"] == (0.5, 10.0) and gaps["0-1 us"] == (0.0, 0.0)
    rows = {r["name"]: r for r in t["kernels"]}
    assert list(rows) == ["gemv", "norm", "shared_mlp", "moe"]  # launch order
    # shares: gemv alone 10; norm alone 12-13 (1), with shared 13-19 (3), with both 19-20 (1/3): 4.33;
    # shared: 3 + 1/3 + (20-25)/2 = 5.83; moe: 1/3 + 2.5 + 25-30 alone (5) = 7.83; they add up to the busy time
    assert rows["gemv"]["share_us_each"] == pytest.approx(10.0)
    assert rows["norm"]["share_us_each"] == pytest.approx(1 + 3 + 1 / 3)
    assert rows["shared_mlp"]["share_us_each"] == pytest.approx(3 + 1 / 3 + 2.5)
    assert rows["moe"]["share_us_each"] == pytest.approx(1 / 3 + 2.5 + 5)
    assert sum(r["share_us_each"] * r["calls_per_step"] for r in t["kernels"]) == pytest.approx(28.0)
    # leads: norm +2; shared_mlp started 7 us before norm ended; moe 6 us before shared_mlp ended; the second
    # step's gemv 20 us after the first step's last kernel (the only lead the window's first gemv has)
    assert [rows[n]["lead_us_each"] for n in ("gemv", "norm", "shared_mlp", "moe")] == pytest.approx([20, 2, -7, -6])
    assert rows["moe"]["grid"] == "[4, 2, 1]" and rows["moe"]["us_each"] == 11.0 and rows["moe"]["family"] == "moe"
    fams = t["share_by_family_us_per_step"]
    assert fams["gemm"] == pytest.approx(10.0) and sum(fams.values()) == pytest.approx(28.0)


def test_kernels_with_one_name_and_different_grids_are_told_apart():
    trace = {"traceEvents": [_kernel("fused_moe_kernel", 7, 0, 5, grid=(176, 1, 1)),
                             _kernel("fused_moe_kernel", 7, 6, 3, grid=(128, 1, 1))]}
    t = timeline(kernels_from_trace(trace), steps=1)
    assert [(r["grid"], r["us_each"]) for r in t["kernels"]] == [("[176, 1, 1]", 5.0), ("[128, 1, 1]", 3.0)]


def test_a_cpu_only_profiler_trace_has_no_kernels(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8) @ torch.ones(8)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    assert kernels_from_trace(json.loads(path.read_text())) == []
    assert timeline([], steps=4) == {}


def _layer_phases(tmp_path, ks, *args) -> subprocess.CompletedProcess:
    """``scripts/layer_phases.py`` over a trace of the kernels ``ks`` ``(name, stream, start, duration, grid)``."""
    trace = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": n, "ts": s, "dur": d,
                              "args": {"stream": st, "grid": list(g)}} for n, st, s, d, g in ks]}
    path = tmp_path / "decode-c1.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "scripts/layer_phases.py", str(path), *args], cwd=repo, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_layer_phases_measures_each_phase_by_the_ends_of_its_kernels(tmp_path):
    """``scripts/layer_phases.py`` over a trace of two synthetic one-token layers (Qwen1.5-MoE's kernels and grids,
    the shared expert on a second stream): each phase from the previous phase's end to its last kernel's end."""
    def layer(t0):  # (name, stream, start, duration, grid)
        return [("FusedAddRMSNormKernel", 7, t0, 2, (1, 1, 1)), ("_gemv_kernel", 7, t0 + 2, 10, (192, 1, 1)),
                ("qkv_decode_attention_kernel", 7, t0 + 4, 16, (1, 16, 16)),  # PDL: it starts early, ends at +20
                ("_gemv_kernel", 7, t0 + 15, 11, (64, 1, 1)), ("FusedAddRMSNormKernel", 7, t0 + 26, 2, (1, 1, 1)),
                ("_router_partial_kernel", 7, t0 + 28, 2, (32, 1, 1)),
                ("_topk_route_partials_kernel", 7, t0 + 30, 3, (1, 1, 1)),
                ("_gemv_kernel", 9, t0 + 33, 25, (352, 1, 1)), ("fused_moe_kernel", 7, t0 + 33, 20, (352, 1, 1)),
                ("fused_moe_kernel", 7, t0 + 53, 12, (256, 1, 1)), ("moe_combine_kernel", 7, t0 + 65, 5, (1, 2, 1))]
    ks = layer(0) + layer(70) + [("FusedAddRMSNormKernel", 7, 140, 2, (1, 1, 1)),
                                 ("_gemv_kernel", 7, 142, 10, (192, 1, 1))]
    out = _layer_phases(tmp_path, ks)
    assert "a layer (median) 70.00 us" in out.stdout, out.stdout
    assert "norm 2.00, qkv 10.00, attention 8.00, o_proj 6.00, norm2 2.00, routing 5.00, moe 37.00 us" in out.stdout
    assert "+0.00   25.00" in out.stdout  # the shared expert's GEMV: from routing's end, 25 us


def test_layer_phases_reads_a_layer_with_the_norm_and_the_routing_folded_into_their_kernels(tmp_path):
    """``linear_fuse_norm`` (the input norm inside the QKV GEMV: no norm kernel, its phase 0, the layer from the
    combine before) and ``moe_route_in_grid`` (no routing kernel: its phase 0, the MoE phase from the norm)."""
    def layer(t0):  # (name, stream, start, duration, grid)
        return [("_add_norm_gemv_kernel", 7, t0, 11, (192, 1, 1)),
                ("qkv_decode_attention_kernel", 7, t0 + 3, 15, (1, 16, 16)),
                ("_gemv_kernel", 7, t0 + 13, 11, (64, 1, 1)),
                ("FusedAddRMSNormKernel", 7, t0 + 24, 2, (1, 1, 1)), ("_route_moe_kernel", 7, t0 + 26, 25, (736, 1, 1)),
                ("fused_moe_kernel", 7, t0 + 49, 12, (512, 1, 1)), ("moe_combine_kernel", 7, t0 + 61, 3, (1, 2, 1))]
    ks = [("moe_combine_kernel", 7, 7, 3, (1, 2, 1))] + layer(10) + layer(74) + [
        ("_add_norm_gemv_kernel", 7, 138, 11, (192, 1, 1))]
    out = _layer_phases(tmp_path, ks)
    assert "a layer (median) 64.00 us" in out.stdout, out.stdout
    assert "norm 0.00, qkv 11.00, attention 7.00, o_proj 6.00, norm2 2.00, routing 0.00, moe 38.00 us" in out.stdout
    assert "_route_moe_kernel" in out.stdout and "+0.00   25.00" in out.stdout  # from the norm's end


def test_layer_phases_reads_layers_whose_norms_are_both_inside_their_kernels_after_a_first_that_keeps_its_own(
        tmp_path):
    """``linear_fuse_norm`` with the post-attention norm inside the routed grid (``router_fuse_norm`` with
    ``moe_route_in_grid``, a branch's): no norm kernel in a layer, both norm phases 0; the first layer, with no
    residual yet, keeps its input norm and a plain QKV GEMV, and counts from that norm's start."""
    def layer(t0, first=False):  # (name, stream, start, duration, grid)
        qkv = ([("RMSNormKernel", 7, t0 - 2, 2, (1, 1, 1)), ("_gemv_kernel", 7, t0, 11, (192, 1, 1))] if first
               else [("_add_norm_gemv_kernel", 7, t0, 11, (192, 1, 1))])
        return qkv + [("qkv_decode_attention_kernel", 7, t0 + 3, 15, (1, 16, 16)),
                      ("_gemv_kernel", 7, t0 + 13, 11, (64, 1, 1)),
                      ("_route_moe_kernel", 7, t0 + 22, 27, (736, 1, 1)),
                      ("fused_moe_kernel", 7, t0 + 47, 12, (512, 1, 1)),
                      ("moe_combine_kernel", 7, t0 + 59, 3, (1, 2, 1))]
    ks = layer(2, first=True) + layer(64) + layer(126) + layer(188) + [
        ("_add_norm_gemv_kernel", 7, 250, 11, (192, 1, 1))]
    out = _layer_phases(tmp_path, ks)
    assert "a layer (median) 62.00 us" in out.stdout, out.stdout
    assert "norm 0.00, qkv 11.00, attention 7.00, o_proj 6.00, norm2 0.00, routing 0.00, moe 38.00 us" in out.stdout
    assert "-2.00   25.00" in out.stdout  # the routed grid, from the output projection's end


def test_layer_phases_finds_the_one_row_gemvs_and_when_the_attention_started(tmp_path):
    """One-token layers whose projections run the one-row GEMV (other grids than ``_gemv_kernel``'s): the GEMVs are
    found by their place around the attention kernel, and the attention's start after the QKV GEMV's is printed."""
    def layer(t0, attn_at):  # (name, stream, start, duration, grid)
        return [("FusedAddRMSNormKernel", 7, t0, 2, (1, 1, 1)), ("_gemv_row_kernel", 7, t0 + 2, 8, (768, 1, 1)),
                ("qkv_decode_attention_kernel", 7, t0 + 2 + attn_at, 12 - attn_at, (1, 16, 16)),
                ("_gemv_row_kernel", 7, t0 + 12, 6, (512, 1, 1)), ("FusedAddRMSNormKernel", 7, t0 + 18, 2, (1, 1, 1)),
                ("_route_moe_kernel", 7, t0 + 20, 25, (736, 1, 1)), ("fused_moe_kernel", 7, t0 + 43, 12, (512, 1, 1)),
                ("moe_combine_kernel", 7, t0 + 55, 3, (1, 2, 1))]
    ks = layer(0, 7) + layer(58, 7) + layer(116, 6) + [("FusedAddRMSNormKernel", 7, 174, 2, (1, 1, 1)),
                                                        ("_gemv_row_kernel", 7, 176, 8, (768, 1, 1)),
                                                        ("qkv_decode_attention_kernel", 7, 178, 10, (1, 16, 16))]
    out = _layer_phases(tmp_path, ks, "--launches")
    assert "a layer (median) 58.00 us" in out.stdout, out.stdout
    assert "norm 2.00, qkv 8.00, attention 4.00, o_proj 4.00, norm2 2.00, routing 0.00, moe 38.00 us" in out.stdout
    assert "the attention kernel started 7.00 us after the QKV GEMV did" in out.stdout
    # --launches: each pair of kernels that follow one another at least 20 times; here none (4 layers)
    assert "kernel -> next kernel" in out.stdout and "qkv_decode_attention_kernel" not in out.stdout.split(
        "kernel -> next kernel")[1]


def test_layer_phases_reads_layers_whose_qkv_gemv_and_attention_are_one_grid(tmp_path):
    """``qkv_gemv_triton.QKV_IN_GRID``: one kernel where the QKV GEMV and the decode attention were two; the qkv
    phase is that grid, the attention phase 0, the output projection the GEMV after it."""
    def layer(t0):  # (name, stream, start, duration, grid)
        return [("_add_rmsnorm_kernel", 7, t0, 2, (1, 1, 1)), ("qkv_gemv_attention_kernel", 7, t0 + 2, 14, (448, 1, 1)),
                ("_gemv_row_kernel", 7, t0 + 14, 4, (512, 1, 1)), ("_add_rmsnorm_kernel", 7, t0 + 18, 2, (1, 1, 1)),
                ("_route_moe_kernel", 7, t0 + 20, 25, (736, 1, 1)), ("fused_moe_kernel", 7, t0 + 43, 12, (512, 1, 1)),
                ("moe_combine_kernel", 7, t0 + 55, 3, (1, 2, 1))]
    ks = layer(0) + layer(58) + layer(116) + [("_add_rmsnorm_kernel", 7, 174, 2, (1, 1, 1)),
                                              ("qkv_gemv_attention_kernel", 7, 176, 14, (448, 1, 1))]
    out = _layer_phases(tmp_path, ks)
    assert "a layer (median) 58.00 us" in out.stdout, out.stdout
    # (the Triton add + RMSNorm after the output projection is the norm2 phase, as FlashInfer's is)
    assert "norm 2.00, qkv 14.00, attention 0.00, o_proj 2.00, norm2 2.00, routing 0.00, moe 38.00 us" in out.stdout


def test_launches_are_timed_from_each_kernels_start():
    """``layer_phases.launches``: for a pair seen often enough, the next kernel's start after the kernel's start
    and before its end (negative: a gap after it)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("layer_phases", Path(__file__).resolve().parents[2] / "scripts"
                                                  / "layer_phases.py")
    lp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lp)
    ks = []
    for i in range(3):  # (name, stream, start, duration, grid): B starts 1 us into A; C 0.5 us after B ends
        t = 100 * i
        ks += [("A", 7, t, 10, "[192, 1, 1]"), ("B", 7, t + 1, 12, "[1, 16, 16]"), ("C", 7, t + 13.5, 2, "[1, 1, 1]")]
    got = {(r[0], r[2]): r[4:] for r in lp.launches(ks, least=3)}
    assert got[("A", "B")] == (3, 1, 9) and got[("B", "C")] == (3, 12.5, -0.5)
    assert ("C", "A") not in got  # only twice


def test_between_steps_measures_from_the_greedy_kernel_to_the_next_qkv_gemv(tmp_path):
    """``layer_phases.between_steps``: per step, the greedy-tokens kernel's end to the next step's first QKV GEMV
    (the GEMV before a decode attention) with the kernels and copies between; the median step's gap is listed."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("layer_phases", Path(__file__).resolve().parents[2] / "scripts"
                                                  / "layer_phases.py")
    lp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lp)

    def ev(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    events = []
    for i, gap in enumerate([9.0, 12.0, 30.0]):
        t = 1000.0 * i  # the greedy kernel ends at t + 2; a copy, the feed, the embedding, then the QKV GEMV
        events += [ev("_greedy_tokens_kernel", t, 2), ev("Memcpy DtoH (Device -> Pinned)", t + 4, 1, "gpu_memcpy"),
                   ev("_feed_kernel", t + 6, 1), ev("_embed_rmsnorm_kernel", t + 8, 1),
                   ev("_gemv_kernel", t + 2 + gap, 10), ev("qkv_decode_attention_kernel", t + 5 + gap, 9),
                   ev("_gemv_kernel", t + 14 + gap, 3)]  # the output projection: not a step's first
    gap, steps, parts = lp.between_steps({"traceEvents": events})
    assert (gap, steps) == (12.0, 3)
    assert [p[0] for p in parts] == ["Memcpy DtoH (Device -> Pinned)", "_feed_kernel", "_embed_rmsnorm_kernel",
                                     "_gemv_kernel"]
    assert parts[0][1:] == (2.0, 1.0) and parts[-1][1] == 12.0
    assert lp.between_steps({"traceEvents": events[1:6]}) == (0.0, 0, [])  # no greedy kernel: nothing to measure
