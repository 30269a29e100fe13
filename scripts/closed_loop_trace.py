"""TTFT of a closed loop of ``c`` requests in flight (``moeserve bench serving``'s offline loop: 512 random prompt
tokens, 128 output tokens, greedy, a new request as soon as one finishes), with a trace of every step that is not a
decode step: when it was launched, its tokens and requests, the host time of its launch and whether it replayed
the piecewise CUDA graphs (the token count it was padded to), and in the JSON the host's waits for earlier steps
while it was the last one launched.

    python scripts/closed_loop_trace.py MODEL OUT.json [key=value ...]

``key=value``: engine options on top of the A/B's (``scripts/decode_ab.py``), e.g. ``prefill_graph_max_tokens=0``.
"""
from __future__ import annotations

import json
import random
import sys
import time


def main() -> int:
    model, out, *sets = sys.argv[1:]
    from decode_ab import build_llm  # this directory: the same engine as the decode A/B
    from moeserve.bench.serving_overhead import _offline_run
    llm = build_llm(model, ["gpu_memory_utilization=0.40", "enable_prefix_caching=false"] + sets)
    eng = llm.engine
    runner = eng.runner
    trace = []
    launch = runner.launch

    def traced(step):
        t0 = time.perf_counter()
        pw = runner.piecewise
        size = pw.bucket(step.num_tokens) if pw is not None and not step.is_decode else None
        res = launch(step)
        trace.append({"t": t0, "launch_ms": 1e3 * (time.perf_counter() - t0), "tokens": step.num_tokens,
                      "reqs": len(step.requests), "decode": step.is_decode, "piece": size})
        return res
    runner.launch = traced
    wait = runner.wait

    def traced_wait(launched):
        t0 = time.perf_counter()
        o = wait(launched)
        if trace:  # the host's waits for steps while this one was the last launched
            trace[-1].setdefault("waits", []).append(1e3 * (time.perf_counter() - t0))
        return o
    runner.wait = traced_wait
    rng = random.Random(0)
    res = {}
    for c in (1, 8):
        prompts = [[rng.randrange(eng.arch.vocab_size) for _ in range(512)] for _ in range(max(8, 4 * c) + c)]
        _offline_run(eng, prompts[:c], c, 128)  # warm-up requests
        trace.clear()
        t0 = time.perf_counter()
        results, _ = _offline_run(eng, prompts[c:], c, 128)
        ttft = sorted(1e3 * x.ttft for x in results)
        steps = [dict(s, t=1e3 * (s["t"] - t0)) for s in trace if not s["decode"]]
        res[c] = {"ttft_ms": ttft, "nondecode_steps": steps, "n_steps": len(trace)}
        print(f"c={c}: TTFT ms {[round(x, 1) for x in ttft]}")
        for s in steps[:12]:
            print("  ", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items() if k != "waits"})
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
