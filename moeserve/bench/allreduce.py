"""All-reduce at decode sizes: NCCL (what the engine runs after each row-parallel layer, then its add+RMSNorm)
against FlashInfer's TensorRT-LLM custom all-reduce and its all-reduce + residual + RMSNorm fusion.

    NCCL_NVLS_ENABLE=0 python -m moeserve.bench.allreduce --tp 2 --hidden 2048 --out allreduce.json

One process per GPU. Each figure is the median time of one operation replayed in a CUDA graph (as decode
steps run), over ``--iters`` replays of ``--ops-per-graph`` operations; every fused result is first checked
against NCCL + the unfused norm (bf16 tolerances printed with the figures). FlashInfer's workspace is the
TRT-LLM IPC / symmetric-memory one (``backend="trtllm"``); the multi-node NVLink backend, which needs NVLink
multicast, is never asked for.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
ATOL = 0.05  # bf16 sums of 2-8 ranks in another order, then RMSNorm (values ~N(0, 1))


def _graph_time_us(fn, ops: int, iters: int) -> float:
    g = torch.cuda.CUDAGraph()
    fn()  # warm-up outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(ops):
            fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / ops)
    return statistics.median(times)


def _rank(rank: int, args, port: int, out_path: str | None) -> None:
    import torch.distributed as dist
    from flashinfer.comm import AllReduceFusionPattern, allreduce_fusion, create_allreduce_fusion_workspace
    from flashinfer.norm import fused_add_rmsnorm
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.tp,
                            device_id=torch.device("cuda", rank))
    dtype, h = torch.bfloat16, args.hidden
    ws = create_allreduce_fusion_workspace(backend="trtllm", world_size=args.tp, rank=rank,
                                           max_token_num=max(args.tokens), hidden_dim=h, dtype=dtype)
    gamma = torch.rand(h, dtype=dtype, device="cuda") + 0.5
    rows = []
    for t in args.tokens:
        g = torch.Generator(device="cuda").manual_seed(1000 * t + rank)
        x = torch.randn(t, h, dtype=dtype, device="cuda", generator=g)
        res = torch.randn(t, h, dtype=torch.float32, device="cuda",
                          generator=torch.Generator(device="cuda").manual_seed(t)).to(dtype)
        # reference: NCCL sum, then the engine's add + RMSNorm
        ref_sum = x.clone()
        dist.all_reduce(ref_sum)
        ref_res, ref_norm = res.clone(), ref_sum.clone()
        fused_add_rmsnorm(ref_norm, ref_res, gamma, 1e-6)
        out = torch.empty_like(x)
        allreduce_fusion(x, ws, AllReduceFusionPattern.kAllReduce, output=out)
        norm_out, res_out = torch.empty_like(x), torch.empty_like(x)
        allreduce_fusion(x, ws, AllReduceFusionPattern.kARResidualRMSNorm, residual_in=res, residual_out=res_out,
                         norm_out=norm_out, rms_gamma=gamma, rms_eps=1e-6)
        torch.cuda.synchronize()
        err_sum = (out.float() - ref_sum.float()).abs().max().item()
        err_norm = (norm_out.float() - ref_norm.float()).abs().max().item()

        buf, r2, n2 = x.clone(), res.clone(), x.clone()

        def nccl_norm():
            dist.all_reduce(buf)
            fused_add_rmsnorm(n2, r2, gamma, 1e-6)
        row = {
            "tokens": t, "bytes": x.numel() * x.element_size(),
            "nccl_allreduce_us": _graph_time_us(lambda: dist.all_reduce(buf), args.ops_per_graph, args.iters),
            "nccl_allreduce_add_rmsnorm_us": _graph_time_us(nccl_norm, args.ops_per_graph, args.iters),
            "flashinfer_allreduce_us": _graph_time_us(
                lambda: allreduce_fusion(x, ws, AllReduceFusionPattern.kAllReduce, output=out),
                args.ops_per_graph, args.iters),
            "flashinfer_allreduce_add_rmsnorm_us": _graph_time_us(
                lambda: allreduce_fusion(x, ws, AllReduceFusionPattern.kARResidualRMSNorm, residual_in=res,
                                         residual_out=res_out, norm_out=norm_out, rms_gamma=gamma, rms_eps=1e-6),
                args.ops_per_graph, args.iters),
            "max_abs_err_allreduce": err_sum, "max_abs_err_add_rmsnorm": err_norm,
            "correct": err_sum <= ATOL and err_norm <= ATOL,
        }
        rows.append(row)
        if rank == 0:
            print(f"T={t:4d}  NCCL {row['nccl_allreduce_us']:7.1f} us (+norm {row['nccl_allreduce_add_rmsnorm_us']:7.1f})"
                  f"  FlashInfer {row['flashinfer_allreduce_us']:7.1f} us (fused norm "
                  f"{row['flashinfer_allreduce_add_rmsnorm_us']:7.1f})  max err {err_sum:.3g} / {err_norm:.3g}",
                  flush=True)
    ws.destroy()
    if rank == 0 and out_path:
        meta = {"tp": args.tp, "hidden": h, "dtype": "bfloat16", "gpu": torch.cuda.get_device_name(0),
                "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"), "atol": ATOL}
        with open(out_path, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=2)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moeserve.bench.allreduce", description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--ops-per-graph", type=int, default=20)
    p.add_argument("--out", default=None, help="write the figures as JSON")
    args = p.parse_args(argv)
    if torch.cuda.device_count() < args.tp:
        print(f"error: --tp {args.tp} needs {args.tp} GPUs; {torch.cuda.device_count()} visible")
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (shared machines)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    from moeserve.ops.parallel import free_port
    torch.multiprocessing.spawn(_rank, args=(args, free_port(), args.out), nprocs=args.tp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
