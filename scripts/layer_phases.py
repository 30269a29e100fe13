"""The phases of a one-token decode layer of Qwen1.5-MoE from a step profile's trace (``moeserve.bench.step_profile
--concurrency 1 --trace-dir DIR`` with the default GPU path: the GEMV, the one-kernel Triton decode attention).

    python scripts/layer_phases.py DIR/decode-c1.json.gz [...] [--launches]

For every layer (from the norm before its QKV GEMV to the norm before the next layer's): the median time from the
end of each phase's last kernel to the end of the next one's (norm, QKV GEMV, attention, output projection, the
post-attention norm, routing, the MoE phase up to the combine), then, inside the MoE phase, each kernel's median
start and end after routing (after the post-attention norm where the routing runs in the MoE's grid), and when the
attention kernel started after the QKV GEMV did. Kernels launched with programmatic dependent launch start before
their predecessor ends (once each of its programs has started), so a phase is measured by ends. ``--launches``
adds, for each pair of kernels that follow one another, when the second started after the first; ``--between``,
what lies between two steps: from the end of a step's greedy-tokens kernel (the LM head's epilogue's last launch)
to the start of the next step's first QKV GEMV, or of the grid of the QKV GEMV and the attention (the median over
the trace's steps), and each kernel and copy in one such gap (start and duration, µs from the greedy kernel's end).
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict

from moeserve.bench.step_profile import kernels_from_trace

PHASES = ["norm", "qkv", "attention", "o_proj", "norm2", "routing", "moe"]
IN_GRID = "qkv_gemv_attention_kernel"  # the QKV GEMV and the decode attention in one grid


def layer_phases(ks: list) -> tuple[dict, dict]:
    end = lambda k: k[2] + k[3]  # noqa: E731
    # the QKV GEMV (the GEMV right before the decode attention); with linear_fuse_norm the input norm is inside it
    # (its phase is then 0, from the combine before; the first layer, with no residual yet, keeps its norm)
    gemvs = ("_gemv_kernel", "_gemv_row_kernel", "_add_norm_gemv_kernel")
    # or the QKV GEMV and the attention in one grid (qkv_gemv_triton): its qkv phase is the grid, its attention 0
    qkv = [i for i, k in enumerate(ks[:-1])
           if (k[0] in gemvs and ks[i + 1][0].startswith("qkv_decode")) or k[0] == IN_GRID]
    # the input norm folded into the kernel before the QKV GEMV: the combine (moe_fuse_norm), the down GEMM that runs
    # the combine (moe_fuse_norm_in_grid), or into the GEMV itself (a branch's _add_norm_gemv_kernel)
    folded = lambda i: ks[i][0] == "_add_norm_gemv_kernel" or "rmsnorm" not in ks[i - 1][0].lower()  # noqa: E731
    # a layer starts where its norm starts, or where the kernel before its QKV GEMV ends when that holds the norm
    start_of = lambda i: end(ks[i - 1]) if folded(i) else ks[i - 1][2]  # noqa: E731
    phases, moe = defaultdict(list), defaultdict(list)
    for i, nxt in zip(qkv, qkv[1:]):
        if nxt - i > 20:  # the last layer of a step: the LM head and sampling follow
            continue
        seg = ks[i - 1: nxt if folded(nxt) else nxt - 1]  # from the norm (folded: the combine) before the QKV GEMV
        attn = next(k for k in seg if k[0].startswith("qkv_decode") or k[0] == IN_GRID)
        o = next(k for k in seg[seg.index(attn):] if k[0] in gemvs)
        # the post-attention norm: FlashInfer's, or the Triton add + RMSNorm (which earlier versions of this script
        # left in the MoE phase: the pages from z to z5)
        n2 = next((k for k in seg if ("FusedAddRMSNorm" in k[0] or k[0] == "_add_rmsnorm_kernel") and k[2] > o[2]),
                  o)  # none with router_fuse_norm in the routed grid (a branch's): its phase is then 0
        topk = next((k for k in seg if k[0].startswith(("_topk_route", "_router_topk"))),  # (the latter: a branch's)
                    n2)  # none with moe_route_in_grid: the routing runs in the MoE's first grid, its phase is 0
        # the combine, or the down GEMM whose last program runs it (moe_fuse_norm_in_grid)
        comb = next((k for k in seg[1:] if k[0] == "moe_combine_kernel"), None) or [
            k for k in seg[1:] if k[0] == "fused_moe_kernel"][-1]
        t = [start_of(i), end(seg[0]), end(seg[1]), end(attn), end(o), end(n2), end(topk), end(comb)]
        for name, a, b in zip(PHASES, t, t[1:]):
            phases[name].append(b - a)
        phases["layer"].append(start_of(nxt) - start_of(i))
        # under PDL the attention kernel is launched once every QKV program has started: how far into the GEMV
        phases["attention launch after qkv start"].append(attn[2] - ks[i][2])
        for k in seg[seg.index(topk) + 1: seg.index(comb) + 1]:
            moe[(k[0][:40], k[4])].append((k[2] - end(topk), end(k) - end(topk)))
    med = statistics.median
    return ({k: med(v) for k, v in phases.items()},
            {k: (med(a for a, _ in v), med(b for _, b in v), len(v)) for k, v in moe.items()})


def launches(ks: list, least: int = 20) -> list[tuple]:
    """For each pair of kernels that follow one another at least ``least`` times in the trace: ``(kernel, grid,
    next kernel, grid, count, median us from the kernel's start to the next one's start, median us from the next
    one's start to the kernel's end)``. Under programmatic dependent launch the next kernel starts once every program
    of the kernel has let it (Triton kernels here right after their wait, FlashInfer's norms at their end), so a
    start well before the end means the next kernel's programs sit on the GPU early."""
    pairs = defaultdict(list)
    for a, b in zip(ks, ks[1:]):
        pairs[(a[0][:40], a[4], b[0][:40], b[4])].append((b[2] - a[2], a[2] + a[3] - b[2]))
    med = statistics.median
    return [(*key, len(v), med(x for x, _ in v), med(y for _, y in v))
            for key, v in sorted(pairs.items(), key=lambda kv: -len(kv[1])) if len(v) >= least]


def between_steps(trace: dict) -> tuple[float, int, list[tuple[str, float, float]]]:
    """``(median µs from a step's greedy-tokens kernel's end to the next step's first QKV GEMV's start, steps, the
    kernels and copies of the median gap: (name, start, duration) µs from that end)``."""
    evs = sorted(((e["name"], float(e["ts"]), float(e["dur"])) for e in trace.get("traceEvents", [])
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e[1])
    gaps = []
    for i, (name, ts, dur) in enumerate(evs):
        if not name.startswith("_greedy_tokens"):
            continue
        j = next((j for j in range(i + 1, min(len(evs) - 1, i + 40))
                  if (evs[j][0] in ("_gemv_kernel", "_gemv_row_kernel") and evs[j + 1][0].startswith("qkv_decode"))
                  or evs[j][0] == IN_GRID), None)
        if j is not None:
            t0 = ts + dur
            gaps.append((evs[j][1] - t0, [(n, a - t0, d) for n, a, d in evs[i + 1:j + 1]]))
    if not gaps:
        return 0.0, 0, []
    gaps.sort(key=lambda g: g[0])
    gap, parts = gaps[len(gaps) // 2]
    return gap, len(gaps), parts


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python scripts/layer_phases.py", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="step_profile's decode-c1.json.gz traces")
    p.add_argument("--launches", action="store_true", help="also when each kernel started after the one before")
    p.add_argument("--between", action="store_true", help="also what lies between two steps")
    args = p.parse_args(argv)
    paths = args.traces
    for path in paths:
        try:
            trace = json.load(gzip.open(path))
        except (OSError, ValueError) as e:
            p.error(f"{path}: not a readable gzipped trace ({e})")
        ks = kernels_from_trace(trace)
        phases, moe = layer_phases(ks)
        print(f"{path}: {len(ks)} kernels; a layer (median) {phases.pop('layer'):.2f} us:")
        launch = phases.pop("attention launch after qkv start")
        print("   " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()) + " us")
        print(f"   the attention kernel started {launch:.2f} us after the QKV GEMV did")
        print("   the MoE phase, us after routing ends (start, end):")
        for (name, grid), (a, b, n) in moe.items():
            print(f"     {name:40s} {grid:13s} {a:+7.2f} {b:7.2f}")
        if args.launches:
            print("   kernel -> next kernel: times; us from its start to the next one's start; from there to its end")
            for a, ga, b, gb, n, start, before_end in launches(ks):
                print(f"     {a:40s} {ga:13s} -> {b:40s} {gb:13s} {n:4d} {start:+8.2f} {before_end:+8.2f}")
        if args.between:
            gap, steps, parts = between_steps(trace)
            print(f"   between steps (median of {steps}): {gap:.2f} us from the greedy tokens' kernel's end to the "
                  "next QKV GEMV; in that gap (start, duration):")
            for name, start, dur in parts:
                print(f"     {name[:60]:60s} {start:+8.2f} {dur:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
