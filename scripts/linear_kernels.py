"""Which kernel cuBLAS runs for each linear of a decode step, and how long it takes: for every linear of the
model (each layer's QKV, O, router and shared-expert projections, and the LM head), one CUDA graph of
``--layers`` launches with distinct weights (so every read comes from HBM, as in a step), timed per launch,
with the kernel's name from the torch profiler and the bandwidth its weights imply. ``--triton`` adds
moeserve's Triton GEMV for the same shapes.

    python scripts/linear_kernels.py --model qwen1.5-moe-a2.7b --rows 1 8
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in names:
            names.append(e.name)
    return names


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen1.5-moe-a2.7b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--triton", action="store_true")
    args = p.parse_args()
    from moeserve.bench.gemv import model_linears
    from moeserve.bench.kernel_cases import own_time_us
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, n, k, bias in model_linears(args.model):
        copies = 1 if name == "lm_head" else args.layers
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies)]
        bs = [torch.randn(n, device=dev, dtype=torch.bfloat16, generator=gen) if bias else None for _ in ws]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            backends = {"cublas": lambda: [F.linear(x, w, b) for w, b in zip(ws, bs)]}
            if args.triton:
                from moeserve.ops.linear_triton import gemv
                backends["triton"] = lambda: [gemv(x, w, b) for w, b in zip(ws, bs)]
            for backend, fn in backends.items():
                try:
                    us, _ = own_time_us(fn, (), graph=True, repeats=30)
                    per = us / copies
                    row = {"linear": name, "N": n, "K": k, "rows": m, "backend": backend, "us": round(per, 2),
                           "gb_s": round(n * k * 2 / per / 1e3, 1), "kernels": kernel_names(fn)[:3]}
                except Exception as e:  # noqa: BLE001 - a backend that cannot run this shape
                    row = {"linear": name, "rows": m, "backend": backend, "error": f"{type(e).__name__}: {e}"[:200]}
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
