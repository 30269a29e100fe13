"""How much a weight fetched into L2 beforehand (``moeserve.ops.l2_prefetch``) speeds up the GEMM that reads it.

For each weight size: L2 is flushed (a 256 MB write), then optionally the weight is prefetched, the GPU idles
for ``--idle-us`` (``torch.cuda._sleep``) and a one-row GEMM reads the weight; CUDA events time the GEMM alone.
A second pass streams ``--stream-mb`` of other data through L2 between the prefetch and the GEMM (as the kernels
between a prefetch and its reader do), with and without ``evict_last``. Median of ``--reps``.

    python scripts/l2_prefetch_probe.py --mb 8 23 46
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from moeserve.ops.l2_prefetch import launch_prefetch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, nargs="+", default=[8, 23, 46])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--idle-us", type=float, default=30.0)
    p.add_argument("--stream-mb", type=float, default=40.0)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    other = torch.empty(int(args.stream_mb * (1 << 20)) // 2, dtype=torch.bfloat16, device=dev)
    sink = torch.empty(1, dtype=torch.float32, device=dev)
    x = torch.randn(1, args.hidden, dtype=torch.bfloat16, device=dev)
    # cycles for the idle time: calibrate torch.cuda._sleep
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(1_000_000)
    e.record()
    torch.cuda.synchronize()
    cycles = int(1_000_000 * args.idle_us / (s.elapsed_time(e) * 1000))
    rows = []
    for mb in args.mb:
        n = int(mb * (1 << 20)) // (2 * args.hidden) // 64 * 64
        w = torch.randn(n, args.hidden, dtype=torch.bfloat16, device=dev)
        for mode in ("none", "prefetch", "prefetch_evict_last", "prefetch+stream", "prefetch_evict_last+stream",
                     "none+stream"):
            times = []
            for _ in range(args.reps):
                flush.fill_(1)
                if mode.startswith("prefetch"):
                    launch_prefetch(w, None, evict_last="evict_last" in mode)
                torch.cuda._sleep(cycles)
                if mode.endswith("+stream"):
                    torch.sum(other, dtype=torch.float32, out=sink)
                s.record()
                torch.nn.functional.linear(x, w)
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e) * 1000)
            us = statistics.median(times)
            rows.append({"mb": round(n * args.hidden * 2 / (1 << 20), 1), "mode": mode, "gemm_us": round(us, 2),
                         "tb_s": round(n * args.hidden * 2 / us / 1e6, 2)})
            print(f"{rows[-1]['mb']:7.1f} MB  {mode:28s} {us:8.2f} us  {rows[-1]['tb_s']:5.2f} TB/s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"idle_us": args.idle_us, "stream_mb": args.stream_mb, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
