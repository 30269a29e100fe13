"""The dense linears of a model at decode batch sizes: cuBLAS (``F.linear``) against moeserve's Triton GEMV, each
checked against a float32 reference and timed as a decode step runs them: back to back in one CUDA graph, each
call on its own copy of the weight (copies enough to hold three times the GPU's L2 cache, so each call reads its
weight from HBM), the GEMV launched with programmatic dependent launch where the GPU has it (``--pdl``, as the
engine's ``pdl_max_tokens``); a call's time is the graph's over the calls. Timed one call at a time instead,
kernels of a few microseconds carry a per-call floor that a step does not have (on an H200 the 2048 x 2048
projection took 9.9 us through cuBLAS and 25.4 us through the GEMV that way, against 6.0 us in a step). With
``--sweep`` the GEMV runs every tile configuration of a small grid (one-row steps also the one-row kernel's) and
the best is reported beside the built-in one (``moeserve.ops.linear_triton.gemv_tiles``).

    python -m moeserve.bench.gemv --model qwen1.5-moe-a2.7b --rows 1 2 4 8 --out gemv.json [--sweep]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from moeserve.bench.graph_timing import time_in_graph_us

TOL = 2e-2  # bf16 output of a float32-accumulated dot product over K <= 8192, against float32
SWEEP = {"BLOCK_N": (16, 32), "BLOCK_K": (256, 512, 1024), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
# one-row steps also sweep the one-row kernel: (BLOCK_N, BLOCK_K, num_warps), each with num_stages 1 and 3
ROW_SWEEP = [(2, 2048, 4), (4, 1024, 4), (4, 2048, 4), (4, 2048, 8), (8, 512, 4), (8, 1024, 4), (8, 1024, 8),
             (8, 2048, 8), (16, 256, 4), (16, 512, 4), (16, 512, 8), (16, 1024, 8), (32, 256, 4), (32, 256, 8),
             (32, 512, 8)]


def model_linears(model: str) -> list[tuple[str, int, int, bool]]:
    """``(name, N, K, bias)`` of each distinct dense linear of one decoder layer, the router and the LM head."""
    from moeserve.config import resolve_model_source
    from moeserve.models import arch_from_hf
    a = arch_from_hf(resolve_model_source(model).config)
    h, q, kv = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    out = [("qkv_proj", q + 2 * kv, h, a.qkv_bias), ("o_proj", h, q, a.o_bias)]
    if a.shared_expert_intermediate_size:
        s = a.shared_expert_intermediate_size
        out += [("shared gate_up", 2 * s, h, False), ("shared down", h, s, False)]
    if a.dense_intermediate_size and not all(a.moe_layers):
        d = a.dense_intermediate_size
        out += [("dense gate_up", 2 * d, h, False), ("dense down", h, d, False)]
    router = a.num_experts + (1 if a.shared_expert_gate else 0)
    out += [("router", -(-router // 8) * 8, h, False), ("lm_head", a.vocab_size, h, False)]
    return out


def copies_for(nbytes: int, l2_bytes: int, least: int = 4, most: int = 1024) -> int:
    """Copies of a weight of ``nbytes`` that hold three times an L2 cache of ``l2_bytes``, from ``least`` to
    ``most`` (a graph of more calls than that takes long to capture; weights that small hardly read HBM)."""
    return min(most, max(least, -(-3 * l2_bytes // max(nbytes, 1))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moeserve.bench.gemv", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen1.5-moe-a2.7b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--sweep", action="store_true", help="also time every tile configuration of a small grid")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--pdl", type=int, default=None, help="launch the GEMV with programmatic dependent launch for "
                   "steps of up to this many rows (default: 64 on compute capability 9.0 and later, else 0)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("moeserve.bench.gemv: needs a CUDA GPU")
        return 2
    from moeserve.ops import pdl
    from moeserve.ops.linear_triton import gemv, gemv_tiles
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    pdl.configure(args.pdl if args.pdl is not None else (64 if props.major >= 9 else 0))
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    configs = [dict(zip(SWEEP, v)) for v in itertools.product(*SWEEP.values())] if args.sweep else []
    row_configs = [{"row": True, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
                   for bn, bk, w in ROW_SWEEP for st in (1, 3)] if args.sweep else []
    for name, n, k, has_bias in model_linears(args.model):
        nbytes = n * k * torch.finfo(dtype).bits // 8
        copies = copies_for(nbytes, props.L2_cache_size)
        ws = [(torch.randn(n, k, device=dev, generator=gen) * 0.02).to(dtype) for _ in range(copies)]
        bs = [(torch.randn(n, device=dev, generator=gen) * 0.02).to(dtype) if has_bias else None for _ in ws]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, generator=gen).to(dtype)
            w, b = ws[0], bs[0]
            ref = F.linear(x.float(), w.float(), None if b is None else b.float())
            err = (gemv(x, w, b).float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
            if err > TOL:
                raise SystemExit(f"{name} M={m}: GEMV differs from the float32 reference by {err:.3g} (> {TOL})")
            cfg = gemv_tiles(m, n, k)  # as the engine runs it

            def timed(fn):
                return time_in_graph_us([lambda w=w, b=b: fn(w, b) for w, b in zip(ws, bs)])
            t_cublas = timed(lambda w, b: F.linear(x, w, b))
            t_gemv = timed(lambda w, b: gemv(x, w, b, cfg))
            row = {"linear": name, "N": n, "K": k, "rows": m, "weight_MB": round(nbytes / 1e6, 2), "copies": copies,
                   "cublas_us": round(t_cublas, 2), "cublas_TBps": round(nbytes / t_cublas / 1e6, 2),
                   "gemv_us": round(t_gemv, 2), "gemv_TBps": round(nbytes / t_gemv / 1e6, 2), "gemv_config": cfg,
                   "rel_err": round(err, 5)}
            print(f"{name:15s} N={n:6d} K={k:5d} M={m:2d}: cuBLAS {t_cublas:7.2f} us ({row['cublas_TBps']:.2f} TB/s)"
                  f"  gemv {t_gemv:7.2f} us ({row['gemv_TBps']:.2f} TB/s)", flush=True)
            if configs and name not in ("lm_head", "router"):
                swept = []
                for c in configs + (row_configs if m == 1 else []):
                    try:
                        swept.append((timed(lambda w, b, c=c: gemv(x, w, b, c)), c))
                    except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory) is skipped
                        if "OutOfResources" not in type(e).__name__:
                            raise
                swept.sort(key=lambda r: r[0])
                best = swept[0]
                row.update(best_us=round(best[0], 2), best_TBps=round(nbytes / best[0] / 1e6, 2), best_config=best[1],
                           top5=[(round(t, 2), c) for t, c in swept[:5]])
                print(f"    best {best[0]:7.2f} us ({row['best_TBps']:.2f} TB/s) {best[1]}; next "
                      + "; ".join(f"{t:.2f} {c}" for t, c in swept[1:4]), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "dtype": args.dtype, "model": args.model,
                       "timing": "one CUDA graph of back-to-back calls on distinct weight copies",
                       "pdl_max_tokens": pdl.max_tokens(), "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
