"""How much a weight fetched into L2 beforehand (``moeserve.ops.l2_prefetch``) speeds up the GEMM that reads it.

For each weight size: L2 is flushed (a 256 MB write), then the weight is prefetched (each method, with and
without ``evict_last``) or not ("cold"), the GPU idles for ``--idle-us`` (``torch.cuda._sleep``; "idle10": 10 us)
and a one-row GEMM reads the weight; CUDA events time the GEMM alone (and the prefetch kernel). "+stream" cases
read ``--stream-mb`` of other data between the prefetch and the GEMM (as the kernels between a prefetch and its
reader do); "warm" reads the weight just before. Median of ``--reps``.

    python scripts/l2_prefetch_probe.py --mb 8 23 46
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from moeserve.ops.l2_prefetch import launch_prefetch
from moeserve.ops.l2_prefetch_triton import METHODS


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
    sink = torch.empty(1, dtype=torch.int32, device=dev)
    x = torch.randn(1, args.hidden, dtype=torch.bfloat16, device=dev)
    # cycles for the idle time: calibrate torch.cuda._sleep
    s, e, p0, p1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    s.record()
    torch.cuda._sleep(1_000_000)
    e.record()
    torch.cuda.synchronize()
    cycles = int(1_000_000 * args.idle_us / (s.elapsed_time(e) * 1000))
    cases = [("warm", None, False, 0, False), ("cold", None, False, 1, False)]
    for method in METHODS:
        for ev in (False, True):
            cases.append((f"{method}{'/evict_last' if ev else ''}", method, ev, 1, False))
        cases.append((f"{method}/evict_last/idle10", method, True, 10 / args.idle_us, False))
        for ev in (False, True):
            cases.append((f"{method}{'/evict_last' if ev else ''}+stream", method, ev, 1, True))
    cases.append(("cold+stream", None, False, 1, True))
    rows = []
    for mb in args.mb:
        n = int(mb * (1 << 20)) // (2 * args.hidden) // 64 * 64
        w = torch.randn(n, args.hidden, dtype=torch.bfloat16, device=dev)
        for name, method, ev, idle, stream in cases:
            times, pre = [], []
            for _ in range(args.reps):
                if name == "warm":
                    torch.nn.functional.linear(x, w)
                else:
                    flush.fill_(1)
                p0.record()
                if method:
                    launch_prefetch(w, None, ev, method, sink)
                p1.record()
                if idle:
                    torch.cuda._sleep(int(cycles * idle))
                if stream:
                    other.sum(dtype=torch.float32)
                s.record()
                torch.nn.functional.linear(x, w)
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e) * 1000)
                pre.append(p0.elapsed_time(p1) * 1000)
            us = statistics.median(times)
            rows.append({"mb": round(n * args.hidden * 2 / (1 << 20), 1), "case": name, "gemm_us": round(us, 2),
                         "tb_s": round(n * args.hidden * 2 / us / 1e6, 2),
                         "prefetch_kernel_us": round(statistics.median(pre), 2) if method else None})
            r = rows[-1]
            print(f"{r['mb']:7.1f} MB  {name:30s} GEMM {us:8.2f} us  {r['tb_s']:5.2f} TB/s"
                  + (f"   prefetch kernel {r['prefetch_kernel_us']:.2f} us" if method else ""), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "idle_us": args.idle_us, "stream_mb": args.stream_mb,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
