"""Where the host time of a prefill step goes: one request of ``--prompt-len`` random tokens at a time, its
first step (the prefill) run under cProfile, with the host time of ``engine.step()`` and the time until the GPU
has finished it (``torch.cuda.synchronize`` after the step), for rounds that start right after the previous
request and rounds that start after ``--idle`` seconds of an idle GPU.

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
    p.add_argument("--out", default="")
    args = p.parse_args()
    import torch

    from moeserve import LLM
    from moeserve.config import load_config, parse_override
    from moeserve.engine.sampling_params import SamplingParams
    opts = dict(model=args.model, dtype="bfloat16", max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=8192,
                gpu_memory_utilization=0.85)
    engine = LLM(config=load_config(None, opts | dict(parse_override(kv) for kv in args.set))).engine
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
        t0 = time.perf_counter()
        if measured:
            prof.enable()
        engine.step()
        if measured:
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
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(25)
        print(f"== cProfile of {len(rows)} prefill steps, by {key}\n" + s.getvalue())
    if args.out:
        with open(f"{args.out}/prefill-profile.json", "w") as f:
            json.dump({"prompt_len": args.prompt_len, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
