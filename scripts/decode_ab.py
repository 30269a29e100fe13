"""Offline decode throughput of whichever moeserve is importable, on one checkpoint: for comparing two commits
of moeserve with the same script, weights and shapes (the benchmark's own command changed between them).

For each concurrency c: c random prompts of ``--prompt-len`` tokens, greedy, ``ignore_eos``; one pass with
``--output-len`` tokens and one with a single token (the prefill alone), each timed after a warm-up pass of
the same shape. Decode tok/s = c * (output_len - 1) / (t_full - t_first_token_only); medians of ``--runs``
(the JSON line also lists every run's time, to tell a slow process from a slow run).

    python scripts/decode_ab.py --model CKPT_DIR --concurrency 1 8 32 [--set kernel_cache_dir=DIR]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import yaml


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--set", action="append", default=[],
                   help="engine option key=value or section.key=value (the value read as YAML, as the CLI's --set)")
    p.add_argument("--label", default="")
    args = p.parse_args()
    opts = dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=8192,
                gpu_memory_utilization=0.85)
    for kv in args.set:
        k, v = kv.split("=", 1)
        *sections, name = k.split(".")  # backends.linear=triton: a field of a nested section
        node = opts
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = yaml.safe_load(v) if v.strip() else ""
    import torch

    from moeserve import LLM, SamplingParams
    llm = LLM(model=args.model, **opts)
    rng = random.Random(0)
    rows = []
    for c in args.concurrency:
        def timed(n_out):
            prompts = [{"prompt_token_ids": [rng.randrange(10, 100000) for _ in range(args.prompt_len)]}
                       for _ in range(c)]
            sp = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts, sp)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        timed(args.output_len)
        timed(1)
        fulls = [timed(args.output_len) for _ in range(args.runs)]
        firsts = [timed(1) for _ in range(args.runs)]
        full, first = statistics.median(fulls), statistics.median(firsts)
        tok_s = c * (args.output_len - 1) / (full - first)
        rows.append({"concurrency": c, "decode_tok_s": round(tok_s, 1), "full_s": round(full, 4),
                     "prefill_s": round(first, 4), "full_runs_s": [round(f, 4) for f in fulls],
                     "prefill_runs_s": [round(f, 4) for f in firsts]})
        print(f"{args.label} c={c}: decode {tok_s:.1f} tok/s (full {full * 1e3:.1f} ms, prefill {first * 1e3:.1f} ms)",
              flush=True)
    print(json.dumps({"label": args.label, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
