"""GPU time of the MoE alignment (``moe_align_block_size``) per plan, per launch, for a decode step's routing.

For each token count, random top-k routing over ``--experts`` experts is aligned by every plan that can take it
(``one-pass`` at each ``--warps``, and ``single``: one program looping over tiles of the ids) inside a CUDA
graph of ``--launches`` back-to-back launches, replayed ``--replays`` times after a warm-up; the figure is the
median replay's time divided by the launches, with programmatic dependent launch off and on (each launch then
waits on the GPU for the one before, as in a decode step). Each plan's output is checked against the
``single`` plan's first.

    python scripts/align_bench.py --tokens 16 32 48 64 --experts 60 --top-k 4 --block-m 16
"""
from __future__ import annotations

import argparse
import json
import statistics


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 48, 64])
    p.add_argument("--experts", type=int, default=60)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--block-m", type=int, default=16)
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--launches", type=int, default=100)
    p.add_argument("--replays", type=int, default=20)
    args = p.parse_args()
    import torch

    from moeserve.ops import pdl
    from moeserve.ops.moe import triton_kernels as tk

    def timed(fn, pdl_tokens: int) -> float:
        with pdl.enabled_as(pdl_tokens):
            for _ in range(3):
                fn()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                for _ in range(args.launches):
                    fn()
        torch.cuda.synchronize()
        graph.replay()
        times = []
        for _ in range(args.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / args.launches)
        return statistics.median(times)

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in args.tokens:
        ids = torch.rand(t, args.experts, generator=gen, device="cuda").topk(args.top_k, dim=1).indices.int()
        saved = tk._ALIGN_ONE_PASS_ELEMS, tk._one_pass_warps
        variants = [("single", 0, 4)] + [(f"one-pass-w{w}", saved[0], w) for w in args.warps]
        want = None
        for name, elems, warps in variants:
            tk._ALIGN_ONE_PASS_ELEMS, tk._one_pass_warps = elems, (lambda *_, w=warps: w)
            try:
                if tk.align_plan(ids.numel(), args.experts) != name.split("-w")[0]:
                    continue
                got = tk.moe_align_block_size(ids, args.block_m, args.experts)
                if want is None:
                    want = got
                same = all(torch.equal(a, b) for a, b in zip(got, want))
                fn = lambda: tk.moe_align_block_size(ids, args.block_m, args.experts)  # noqa: E731
                row = {"tokens": t, "plan": name, "same_as_single": same, "us_no_pdl": timed(fn, 0),
                       "us_pdl": timed(fn, t)}
            finally:
                tk._ALIGN_ONE_PASS_ELEMS, tk._one_pass_warps = saved
            rows.append(row)
            print(f"T={t:4d} {name:14s} {row['us_no_pdl']:7.2f} us  (PDL {row['us_pdl']:7.2f} us)"
                  f"{'' if same else '  OUTPUT DIFFERS'}", flush=True)
    print(json.dumps({"experts": args.experts, "top_k": args.top_k, "block_m": args.block_m, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
