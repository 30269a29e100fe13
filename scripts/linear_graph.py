"""The dense linears of one decode step, as a decode step runs them: every layer's QKV, O, shared-expert
gate/up and down projections and the LM head, each with its own weights (so every read comes from HBM), in one
CUDA graph per backend; the replay time against the bytes read. Backends: cuBLAS (``F.linear``), FlashInfer's
``tinygemm_bf16`` (TRT-LLM's tinygemm2, made for 1-8 rows) with and without programmatic dependent launch, and
moeserve's Triton GEMV. Each is checked against ``F.linear`` first.

    python scripts/linear_graph.py --model qwen1.5-moe-a2.7b --rows 1 2 4 8
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def shapes(model: str) -> list[tuple[str, int, int]]:
    from moeserve.bench.gemv import model_linears
    from moeserve.config import resolve_model_source
    from moeserve.models import arch_from_hf
    a = arch_from_hf(resolve_model_source(model).config)
    per_layer = [(n, N, K) for n, N, K, _ in model_linears(model) if n not in ("router", "lm_head")]
    out = [(f"{n}.{i}", N, K) for i in range(a.num_layers) for n, N, K in per_layer]
    return out + [("lm_head", a.vocab_size, a.hidden_size)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen1.5-moe-a2.7b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--backends", default="cublas,tinygemm,tinygemm-pdl,triton")
    args = p.parse_args()
    from moeserve.bench.kernel_cases import own_time_us
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    lin = shapes(args.model)
    weights = [torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02 for _, N, K in lin]
    nbytes = sum(w.numel() * 2 for w in weights)
    out_rows = []
    for m in args.rows:
        xs = {K: torch.randn(m, K, device=dev, dtype=torch.bfloat16, generator=gen) for _, _, K in lin}
        outs = [torch.empty(m, N, device=dev, dtype=torch.bfloat16) for _, N, _ in lin]
        refs = [F.linear(xs[K], w) for (_, _, K), w in zip(lin, weights)]

        def runner(name):
            if name == "cublas":
                return lambda: [torch.matmul(xs[K], w.t(), out=o) for (_, _, K), w, o in zip(lin, weights, outs)]
            if name.startswith("tinygemm"):
                from flashinfer.gemm import tinygemm_bf16
                pdl = name.endswith("pdl")
                return lambda: [tinygemm_bf16(xs[K], w, o, use_pdl=pdl) for (_, _, K), w, o in zip(lin, weights, outs)]
            if name == "triton":
                from moeserve.ops.linear_triton import gemv
                return lambda: [o.copy_(gemv(xs[K], w)) for (_, _, K), w, o in zip(lin, weights, outs)]
            raise ValueError(name)

        for name in args.backends.split(","):
            row = {"rows": m, "backend": name, "weights_gb": round(nbytes / 1e9, 3)}
            try:
                fn = runner(name)
                fn()
                torch.cuda.synchronize()
                err = max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, refs))
                row["max_abs_err"] = err
                us, _ = own_time_us(fn, (), graph=True, repeats=args.replays)  # 256 MiB L2 flush per replay
                ms = us / 1e3
                row.update(ms=round(ms, 4), gb_s=round(nbytes / ms / 1e6, 1))
            except Exception as e:  # noqa: BLE001 - a backend that cannot run these shapes
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            out_rows.append(row)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
