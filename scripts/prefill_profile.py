"""Where the host time of a prefill step goes: one request of ``--prompt-len`` random tokens at a time, its
first step (the prefill) run under cProfile, with the host time of ``engine.step()`` and the time until the GPU
has finished it (``torch.cuda.synchronize`` after the step), for rounds that start right after the previous
request and rounds that start after ``--idle`` seconds of an idle GPU. ``--no-cprofile`` times the same steps
without the profiler (which slows Python-heavy code several-fold), then one more under torch's CUDA profiler for
the sum of its kernels' GPU times.

    python scripts/prefill_profile.py --model CKPT_DIR [--set kernel_cache_dir=DIR] [--out DIR]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--idle", type=float, default=0.5)
    p.add_argument("--set", action="append", default=[], help="engine option key=value, as the CLI's --set")
    p.add_argument("--no-cprofile", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args()
    import torch

    from decode_ab import build_llm  # this directory: the same engine as the decode A/B
    from moeserve.engine.sampling_params import SamplingParams
    engine = build_llm(args.model, args.set).engine
    vocab = engine.arch.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2, detokenize=False)
    prof = cProfile.Profile()
    rows = []
    for i in range(2 + 2 * args.rounds):  # two warm-up rounds, then alternating: no idle, idle
        idle = args.idle if i >= 2 and i % 2 else 0.0
        time.sleep(idle)
        engine.add_request([rng.randrange(vocab) for _ in range(args.prompt_len)], params)
        measured = i >= 2
        profiled = measured and not args.no_cprofile
        t0 = time.perf_counter()
        if profiled:
            prof.enable()
        engine.step()
        if profiled:
            prof.disable()
        t1 = time.perf_counter()
        launch = engine.last_step_seconds[0]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        if measured:
            rows.append({"idle_s": idle, "step_host_ms": 1e3 * (t1 - t0), "until_gpu_done_ms": 1e3 * (t2 - t0),
                         "launch_ms": 1e3 * launch})
            r = rows[-1]
            print(f"prefill of {args.prompt_len} tokens after {idle:.1f} s idle: step {r['step_host_ms']:.1f} ms on"
                  f" the host (launch {r['launch_ms']:.1f}), GPU done at {r['until_gpu_done_ms']:.1f} ms", flush=True)
    busy_ms = None
    if args.no_cprofile and torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile
        engine.add_request([rng.randrange(vocab) for _ in range(args.prompt_len)], params)
        with profile(activities=[ProfilerActivity.CUDA]) as tp:
            engine.step()
            torch.cuda.synchronize()
        while engine.has_unfinished():
            engine.step()
        busy_ms = sum(e.self_device_time_total for e in tp.key_averages()) / 1e3
        print(f"prefill of {args.prompt_len} tokens under torch's CUDA profiler: kernels {busy_ms:.1f} ms of GPU time")
    for key in ("tottime", "cumulative") if not args.no_cprofile else ():
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(25)
        print(f"== cProfile of {len(rows)} prefill steps, by {key}\n" + s.getvalue())
    if args.out:
        name = "prefill-times" if args.no_cprofile else "prefill-profile"
        with open(f"{args.out}/{name}.json", "w") as f:
            json.dump({"prompt_len": args.prompt_len, "cprofile": not args.no_cprofile, "rows": rows,
                       "gpu_kernel_ms": busy_ms}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
