"""Where a decode step's time goes: the torch profiler over steady-state decode steps, per kernel.

``python -m moeserve.bench.step_profile [engine flags] --concurrency 1 32`` prints, for each concurrency,
the wall time of a step, the GPU time of its kernels grouped by family (attention, MoE, GEMM, norm, ...)
and the top kernels, and writes the same as JSON with ``--out``. Compile and warm-up stay outside the
profiled window.
"""
from __future__ import annotations

import argparse
import json
import re
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


def profile_decode(engine, concurrency: int, prompt_len: int, steps: int, seed: int = 0) -> dict:
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
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_profile: needs a CUDA GPU")
        return 2
    engine = LLMEngine(config_from_args(args))
    results = {"engine": engine.describe(), "profiles": []}
    for c in args.concurrency:
        r = profile_decode(engine, c, args.prompt_len, args.steps)
        results["profiles"].append(r)
        print(f"\n== decode step at concurrency {c}: wall {r['step_wall_ms']:.3f} ms, GPU kernels "
              f"{r['step_gpu_ms']:.3f} ms ({100 * r['gpu_busy_fraction']:.0f}% busy)")
        for fam, ms in r["families_ms_per_step"].items():
            print(f"   {fam:<11} {ms:8.3f} ms")
        for k in r["top_kernels"][:8]:
            print(f"   {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<5.0f} {k['name'][:90]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
