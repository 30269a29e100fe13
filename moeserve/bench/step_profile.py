"""Where a decode step's time goes: the torch profiler over steady-state decode steps, per kernel.

``python -m moeserve.bench.step_profile [engine flags] --concurrency 1 32`` prints, for each concurrency,
the wall time of a step, the GPU time of its kernels grouped by family (attention, MoE, GEMM, norm, ...)
and the top kernels, and writes the same as JSON with ``--out``. Compile and warm-up stay outside the
profiled window.

It also reads the kernels' timeline (the profiler's trace, which ``--trace-dir`` keeps gzipped): how much of
a step some kernel is running on the GPU, how much two or more are (the shared expert beside the routed
experts; a kernel launched with programmatic dependent launch beside the one it waits for) and how much none
is, the idle gaps by size, and for each kernel (name and grid, in launch order) its running time, its share
of the step's busy time (each instant split evenly among the kernels running then) and its lead: the time
from the end of every kernel started before it to its start (positive: the GPU was idle, waiting for its
launch or for the host; negative: it overlapped them). Kernels replayed from a CUDA graph are reported on the
graph's internal streams, so the view does not go by stream.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import tempfile
import time
from collections import defaultdict

import torch

FAMILIES = [  # the first match names a kernel's family
    ("qkv", r"qkv_rope_append"),  # q/k norms, rotary embedding and KV append in one kernel
    ("attention", r"prefill|decode|attention|fmha|xqa|BatchPrefill|BatchDecode|AppendPaged|append"),
    ("moe", r"fused_moe|moe|expert|cutlass.*group|grouped"),
    ("gemm", r"gemm|gemv|cublas|sm90_xmma|nvjet|cutlass|matmul|Kernel2"),
    ("norm", r"norm"),
    ("rope", r"rope|rotary"),
    ("activation", r"silu|act_and_mul"),
    ("sampling", r"argmax|sampling|top_p|renorm"),
    # greedy decode: softmax and top-k are routing's; so are the router's split-K partial sums
    ("routing", r"topk|top_k|bitonicSort|softmax|noaux|dsv3|router_partial"),
    ("copy", r"copy|memcpy|memset|fill|cat|index"),
]


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return fam
    return "other"


GAP_BUCKETS_US = (1.0, 3.0, 10.0)  # idle gaps are counted as < 1, 1-3, 3-10 and >= 10 microseconds


def kernels_from_trace(trace: dict) -> list[tuple[str, int, float, float, str]]:
    """The GPU kernels of a torch profiler (Chrome) trace: (name, stream, start us, duration us, grid)."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        args = e.get("args", {})
        stream = args.get("stream", e.get("tid", 0))
        out.append((e["name"], int(stream), float(e["ts"]), float(e["dur"]), str(args.get("grid", ""))))
    return sorted(out, key=lambda k: k[2])


def timeline(kernels: list[tuple[str, int, float, float, str]], steps: int) -> dict:
    """How ``steps`` decode steps' kernels fill the GPU's time (see the module's docstring)."""
    if not kernels or steps <= 0:
        return {}
    ks = sorted(kernels, key=lambda k: k[2])
    ivs = [(s, s + d) for _, _, s, d, _ in ks]
    busy, gaps = 0.0, []
    lo, hi = ivs[0]
    for s, e in ivs[1:]:
        if s > hi:
            busy += hi - lo
            gaps.append(s - hi)
            lo, hi = s, e
        else:
            hi = max(hi, e)
    busy += hi - lo
    window = ivs[-1][1] - ivs[0][0]
    edges = (0.0,) + GAP_BUCKETS_US + (float("inf"),)
    buckets = []
    for a, b in zip(edges, edges[1:]):
        sel = [g for g in gaps if a <= g < b]
        label = f">= {a:g} us" if b == float("inf") else f"{a:g}-{b:g} us"
        buckets.append({"gap": label, "per_step": len(sel) / steps, "us_per_step": sum(sel) / steps})
    # each instant of busy time is shared evenly by the kernels running then; the shares add up to the busy time
    # (a kernel waiting in griddepcontrol.wait for its predecessor counts as running: PDL moves time between them)
    share = [0.0] * len(ks)
    events = sorted([(s, 1, i) for i, (s, _) in enumerate(ivs)] + [(e, 0, i) for i, (_, e) in enumerate(ivs)])
    running: set[int] = set()
    last, overlapped = ivs[0][0], 0.0
    for t, starts, i in events:
        if running and t > last:
            for r in running:
                share[r] += (t - last) / len(running)
            if len(running) > 1:
                overlapped += t - last
        last = t
        (running.add if starts else running.discard)(i)
    rows: dict[tuple[str, str], list] = {}  # (name, grid) -> calls, running, share, lead, leads; launch order
    front = None
    for i, (name, _, s, d, grid) in enumerate(ks):
        r = rows.setdefault((name, grid), [0, 0.0, 0.0, 0.0, 0])
        r[0] += 1
        r[1] += d
        r[2] += share[i]
        if front is not None:  # the window's first kernel has no predecessor
            r[3] += s - front
            r[4] += 1
        front = s + d if front is None else max(front, s + d)
    fams: dict[str, float] = defaultdict(float)
    for (name, _), r in rows.items():
        fams[family(name)] += r[2] / steps
    return {
        "window_us_per_step": window / steps,
        "gpu_busy_us_per_step": busy / steps,
        "gpu_idle_us_per_step": (window - busy) / steps,
        "overlapped_us_per_step": overlapped / steps,
        "idle_gaps": buckets,
        "streams": len({k[1] for k in ks}),
        "share_by_family_us_per_step": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
        "kernels": [{"name": name[:120], "grid": grid, "family": family(name), "calls_per_step": c / steps,
                     "us_each": d / c, "share_us_each": sh / c, "lead_us_each": ld / n if n else 0.0}
                    for (name, grid), (c, d, sh, ld, n) in rows.items()],
    }


def print_timeline(t: dict) -> None:
    if not t:
        return
    print(f"   timeline: {t['window_us_per_step']:.1f} us per step: some kernel running "
          f"{t['gpu_busy_us_per_step']:.1f} (two or more {t['overlapped_us_per_step']:.1f}), none "
          f"{t['gpu_idle_us_per_step']:.1f}")
    print("   idle gaps per step: " + ", ".join(f"{b['gap']}: {b['per_step']:.0f} ({b['us_per_step']:.1f} us)"
                                              for b in t["idle_gaps"]))
    print("   busy time by family (each instant shared by the kernels running): " + ", ".join(
        f"{k} {v:.1f}" for k, v in t["share_by_family_us_per_step"].items()) + " us")
    print("   kernels in launch order: calls per step, us each running, us each of the step's busy time, lead (us from"
          " the end of every earlier kernel to its start; negative: it overlapped them)")
    for r in t["kernels"]:
        print(f"     x{r['calls_per_step']:<4.0f} {r['us_each']:7.2f} {r['share_us_each']:7.2f} "
              f"{r['lead_us_each']:+8.2f}  {r['family']:<10} {r['name'][:56]} {r['grid']}")


def profile_decode(engine, concurrency: int, prompt_len: int, steps: int, seed: int = 0,
                   trace_dir: str | None = None) -> dict:
    from moeserve.engine.sampling_params import SamplingParams
    g = torch.Generator().manual_seed(seed)
    vocab = engine.arch.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    seqs = [engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
            for _ in range(concurrency)]
    while any(not s.output_token_ids for s in seqs):  # prefill everything first
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    for s in seqs:
        engine.abort_request(s.request_id)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f:
            raw = f.read()
    line = timeline(kernels_from_trace(json.loads(raw)), steps)
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        with gzip.open(os.path.join(trace_dir, f"decode-c{concurrency}.json.gz"), "wb") as f:
            f.write(raw)
    kernels = defaultdict(lambda: [0, 0.0])
    for evt in prof.key_averages():
        dev_us = getattr(evt, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "self_cuda_time_total", 0)
        if dev_us and evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.key][0] += evt.count
            kernels[evt.key][1] += dev_us
    total_gpu = sum(v[1] for v in kernels.values())
    fams = defaultdict(float)
    for name, (_, us) in kernels.items():
        fams[family(name)] += us
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:15]
    return {
        "concurrency": concurrency, "steps": steps, "step_wall_ms": 1e3 * wall / steps,
        "step_gpu_ms": total_gpu / 1e3 / steps, "gpu_busy_fraction": (total_gpu / 1e6) / wall if wall else 0,
        "families_ms_per_step": {k: v / 1e3 / steps for k, v in sorted(fams.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:120], "calls_per_step": c / steps, "ms_per_step": us / 1e3 / steps}
                        for n, (c, us) in top],
        "timeline": line,
    }


def main(argv=None) -> int:
    from moeserve.args import add_config_args, config_from_args
    from moeserve.engine.engine import LLMEngine
    p = argparse.ArgumentParser(prog="python -m moeserve.bench.step_profile", description=__doc__.split("\n")[0])
    add_config_args(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--trace-dir", help="keep each concurrency's profiler trace here (decode-c<N>.json.gz)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_profile: needs a CUDA GPU")
        return 2
    engine = LLMEngine(config_from_args(args))
    results = {"engine": engine.describe(), "profiles": []}
    for c in args.concurrency:
        r = profile_decode(engine, c, args.prompt_len, args.steps, trace_dir=args.trace_dir)
        results["profiles"].append(r)
        print(f"\n== decode step at concurrency {c}: wall {r['step_wall_ms']:.3f} ms, GPU kernels "
              f"{r['step_gpu_ms']:.3f} ms ({100 * r['gpu_busy_fraction']:.0f}% busy)")
        for fam, ms in r["families_ms_per_step"].items():
            print(f"   {fam:<11} {ms:8.3f} ms")
        for k in r["top_kernels"][:8]:
            print(f"   {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<5.0f} {k['name'][:90]}")
        print_timeline(r["timeline"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
