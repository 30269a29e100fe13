"""How fast one kernel of a one-token decode step can read its weight: a pure streaming read (each program sums a
contiguous slice) at the sizes of the step's linears and MoE GEMMs, beside cuBLAS, the Triton GEMV and the one-row
GEMV (``linear_triton._gemv_row_kernel``) on the dense linears, all timed as a step runs them (back to back in one
CUDA graph, each call on its own copy of the weight, launched with programmatic dependent launch). The read's time
against its bytes says what a kernel boundary costs at each size; the GEMVs' against the read, what their loop
does. ``--tiles-out`` writes the fastest one-row tiles as ``{"N,K": config}``.

    python scripts/read_floor.py --model qwen1.5-moe-a2.7b --out read-floor.json [--tiles-out row-tiles.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.ops.pdl_triton import wait_prior

TOL = 2e-2
# one-row GEMV tiles: (BLOCK_N, BLOCK_K, num_warps), each with num_stages 1 and 3
ROW_TILES = [(2, 2048, 4), (4, 1024, 4), (4, 2048, 4), (4, 2048, 8), (8, 512, 4), (8, 1024, 4), (8, 1024, 8),
             (8, 2048, 8), (16, 256, 4), (16, 512, 4), (16, 512, 8), (16, 1024, 8), (32, 256, 4), (32, 256, 8),
             (32, 512, 8)]
READ_BLOCKS = (2048, 8192)
READ_PROGRAMS_PER_SM = (1, 2, 4, 8)


@triton.jit
def _read_kernel(w_ptr, out_ptr, per_program, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_prior(PDL)
    pid = tl.program_id(0)
    base = w_ptr + pid.to(tl.int64) * per_program
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, per_program, BLOCK):
        acc += tl.load(base + i + offs).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_call(w: torch.Tensor, out: torch.Tensor, programs: int, block: int):
    per = w.numel() // programs // block * block

    def call():
        _read_kernel[(programs,)](w, out, per, BLOCK=block, PDL=True, launch_pdl=True)
    return call, per * programs * w.element_size()


def time_linear(name: str, n: int, k: int, has_bias: bool, dev, gen, l2: int) -> dict:
    """cuBLAS, the GEMV and every one-row tile of :data:`ROW_TILES` on a one-row step of an ``[n, k]`` linear."""
    from moeserve.bench.gemv import copies_for
    from moeserve.bench.graph_timing import time_in_graph_us
    from moeserve.ops.linear_triton import gemv, gemv_config
    dtype = torch.bfloat16
    copies = copies_for(n * k * 2, l2)
    ws = [(torch.randn(n, k, device=dev, generator=gen) * 0.02).to(dtype) for _ in range(copies)]
    bs = [(torch.randn(n, device=dev, generator=gen) * 0.02).to(dtype) if has_bias else None for _ in ws]
    x = torch.randn(1, k, device=dev, generator=gen).to(dtype)
    ref = F.linear(x.float(), ws[0].float(), None if bs[0] is None else bs[0].float())

    def timed(fn):
        return round(time_in_graph_us([lambda w=w, b=b: fn(w, b) for w, b in zip(ws, bs)]), 2)
    row = {"linear": name, "N": n, "K": k, "MB": round(n * k * 2 / 1e6, 2),
           "cublas_us": timed(lambda w, b: F.linear(x, w, b)),
           "gemv_us": timed(lambda w, b: gemv(x, w, b, gemv_config(n, k))), "gemv_config": gemv_config(n, k)}
    swept = []
    for bn, bk, warps in ROW_TILES:
        if bk > k:
            continue
        for stages in (1, 3):
            c = {"row": 1, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
            y = gemv(x, ws[0], bs[0], c).float()
            e = ((y - ref).abs().max() / ref.abs().max()).item()
            if e > TOL:
                raise SystemExit(f"{name}: one-row GEMV {c} differs from float32 by {e:.3g} (> {TOL})")
            swept.append((timed(lambda w, b, c=c: gemv(x, w, b, c)), c))
    swept.sort(key=lambda r: r[0])
    row.update(row_best_us=swept[0][0], row_best_config=swept[0][1], row_all=swept)
    print(f"{name:15s} {row['MB']:7.2f} MB: cuBLAS {row['cublas_us']:6.2f}  gemv {row['gemv_us']:6.2f}  "
          f"row {swept[0][0]:6.2f} us {swept[0][1]}; next " + "; ".join(f"{t} {c}" for t, c in swept[1:4]), flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen1.5-moe-a2.7b")
    p.add_argument("--out", default=None)
    p.add_argument("--tiles-out", default=None)
    p.add_argument("--all", action="store_true", help="also the shared expert's linears (one-token steps run it "
                   "inside the fused MoE)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("read_floor: needs a CUDA GPU")
        return 2
    from moeserve.bench.gemv import copies_for, model_linears
    from moeserve.bench.graph_timing import time_in_graph_us
    from moeserve.ops import pdl
    pdl.configure(64)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    gen = torch.Generator(device=dev).manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(), "sms": sms, "reads": [], "linears": []}

    def read_floor(label: str, nbytes: int):
        numel = nbytes // 2
        copies = copies_for(nbytes, l2, least=2)
        ws = [torch.empty(numel, device=dev, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen) for _ in range(copies)]
        out = torch.empty(8 * sms, device=dev)
        best = None
        for block in READ_BLOCKS:
            for per_sm in READ_PROGRAMS_PER_SM:
                if numel // (per_sm * sms) < block:
                    continue
                calls, nb = zip(*[read_call(w, out, per_sm * sms, block) for w in ws])
                t = time_in_graph_us(list(calls))
                row = {"what": label, "MB": round(nb[0] / 1e6, 2), "block": block, "programs": per_sm * sms,
                       "us": round(t, 2), "TBps": round(nb[0] / t / 1e6, 3)}
                result["reads"].append(row)
                if best is None or t < best["us"]:
                    best = row
        print(f"read {label:16s} {best['MB']:8.2f} MB: best {best['us']:8.2f} us ({best['TBps']:.2f} TB/s) with "
              f"{best['programs']} programs of {best['block']}", flush=True)
        del ws

    linears = [(n, N, K, b) for n, N, K, b in model_linears(args.model)
               if n not in ("router", "lm_head") and (args.all or not n.startswith("shared"))]
    tiles = {}
    for name, n, k, has_bias in linears:
        row = time_linear(name, n, k, has_bias, dev, gen, l2)
        tiles[f"{n},{k}"] = row["row_best_config"]
        result["linears"].append(row)
        read_floor(name, n * k * 2)
    for label, mb in (("moe gate/up c=1", 92.3), ("moe down c=1", 46.1), ("lm head", 622.3)):
        read_floor(label, int(mb * 1e6) // 4096 * 4096)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.tiles_out:
        with open(args.tiles_out, "w") as f:
            json.dump(tiles, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
