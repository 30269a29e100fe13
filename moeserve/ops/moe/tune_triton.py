"""Tune fused-MoE Triton tile configs on the current GPU under a wall-clock budget.

Example::

    python -m moeserve.ops.moe.tune_triton --shapes qwen1.5 qwen3 \\
        --batch-sizes 1 2 4 8 16 32 64 128 256 512 1024 2048 4096 --budget-s 240

For every shape and token count ``M`` it times a pruned search space with CUDA graphs on random inputs with
uniform random routing: first a set of tile shapes near the default config, then warps/stages/grouping
variants of the two fastest tiles. The winner is checked against an fp32 torch reference and written to
``--out`` (file named by :func:`config_file_name`) after every ``M``, so partial results survive. Once
the budget is spent, remaining token counts only time the default and the previous winner (both compiled).

High-precision experts are timed as the engine runs them: gate/up rows interleaved (the activation in the first
GEMM's epilogue) and steps of up to ``moe_pairwise_max_tokens`` tokens without the alignment
(``--gate-then-up``: the older layout).

``--dtype fp8_w8a8`` tunes the FP8 block-scale kernel (``fp8_triton.fused_moe_fp8``: e4m3 experts with
128x128 scales, activations quantised per token group of 128) and writes the table it loads
(``...,dtype=fp8_w8a8,block_shape=[128,128].json``); ``BLOCK_SIZE_K`` then stays a divisor of 128, the
reference quantises the activations the same way, and tiles compile when first timed.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
import triton

from moeserve.config import EngineConfig
from moeserve.quant.fp8 import (BLOCK, block_dequant_fp8, block_quant_fp8, per_token_group_dequant,
                                per_token_group_quant_fp8)

from .fp8_triton import BLOCK_SHAPE, FP8_CONFIG_TAG, default_fp8_config, fused_moe_fp8
from .triton_configs import CONFIG_DIR, CONFIG_KEYS, config_file_name, default_config, device_name, parse_configs
from .triton_kernels import deinterleave_gate_up, fused_moe, fused_moe_warmup, interleave_gate_up

SHAPES = {"qwen1.5": (60, 1408, 2048, 4), "qwen3": (128, 768, 2048, 8), "glm4.5-air": (128, 1408, 4096, 8)}
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
SPACE = dict(BLOCK_SIZE_M=(16, 32, 64, 128), BLOCK_SIZE_N=(32, 64, 128, 256), BLOCK_SIZE_K=(64, 128, 256),
             GROUP_SIZE_M=(1, 16, 32), num_warps=(4, 8), num_stages=(2, 3, 4, 5))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, FP8_CONFIG_TAG: torch.bfloat16}  # activation dtypes
REL_ERR_LIMIT = 2e-2
ENGINE_PAIRWISE_MAX_TOKENS = EngineConfig.model_fields["moe_pairwise_max_tokens"].default
REL_ERR_LIMIT_FP8 = 2.5e-2  # against the reference above (tests/test_gpu_fp8.py uses the same bound)
SECONDS_PER_PAIR_RESERVE = 0.4
TARGET_REPLAY_US = 300.0


def log(msg: str) -> None:
    """Print a progress line immediately."""
    print(msg, flush=True)


def cfg_key(cfg: dict) -> tuple:
    """Hashable identity of a config."""
    return tuple(int(cfg[k]) for k in CONFIG_KEYS)


def cfg_str(cfg: dict) -> str:
    """Compact form ``BMxBNxBK gG wW sS``."""
    return (f"{cfg['BLOCK_SIZE_M']}x{cfg['BLOCK_SIZE_N']}x{cfg['BLOCK_SIZE_K']} g{cfg['GROUP_SIZE_M']} "
            f"w{cfg['num_warps']} s{cfg['num_stages']}")


def smem_limit() -> int:
    """Per-block shared memory limit of the current device in bytes."""
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
        return int(props["max_shared_mem"])
    except Exception:
        return 232448


def fits(cfg: dict, elsize: int, smem: int) -> bool:
    """Whether a config plausibly fits shared memory and registers and uses its warps sensibly."""
    bm, bn, bk, w, s = (cfg[k] for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages"))
    if s * (bm * bk + bk * bn) * elsize + 1024 > smem:
        return False
    if bm * bn > 4096 * w or (w == 8 and bm * bn < 64 * 64):
        return False
    return True


def group_matters(M: int, E: int, top_k: int, bm: int) -> bool:
    """Grouping only changes anything when experts hold several row blocks on average."""
    return M * top_k / E > bm


def tile_candidates(M: int, E: int, top_k: int, elsize: int, smem: int, dtype: torch.dtype, limit: int) -> list[dict]:
    """Phase 1: tile shapes (BM, BN, BK) nearest the default config, each with standard warps/stages/group."""
    per_expert = M * top_k / E
    bm_max = max(16, 2 * triton.next_power_of_2(max(1, math.ceil(per_expert))))
    bm_min = 16 if per_expert < 256 else 32 if per_expert < 1024 else 64
    base = default_config(M, E, 0, 0, top_k, dtype)
    out = []
    for bm, bn, bk in itertools.product(SPACE["BLOCK_SIZE_M"], SPACE["BLOCK_SIZE_N"], SPACE["BLOCK_SIZE_K"]):
        if not bm_min <= bm <= bm_max:
            continue
        cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
                   GROUP_SIZE_M=16 if group_matters(M, E, top_k, bm) else 1,
                   num_warps=4 if bm * bn <= 64 * 128 else 8, num_stages=4)
        while cfg["num_stages"] > 2 and not fits(cfg, elsize, smem):
            cfg["num_stages"] -= 1
        if fits(cfg, elsize, smem):
            dist = sum(abs(math.log2(cfg[k] / base[k])) for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"))
            out.append((dist, bn * bk, cfg))
    out.sort(key=lambda t: (t[0], t[1]))
    return [c for _, _, c in out[:limit]]


def variant_candidates(tiles: list[dict], M: int, E: int, top_k: int, elsize: int, smem: int) -> list[dict]:
    """Phase 2: warps/stages/group variants of the given tiles, nearest variants first, tiles interleaved."""
    per_tile = []
    for t in tiles:
        groups = SPACE["GROUP_SIZE_M"] if group_matters(M, E, top_k, t["BLOCK_SIZE_M"]) else (1,)
        vs = []
        for g, w, s in itertools.product(groups, SPACE["num_warps"], SPACE["num_stages"]):
            cfg = dict(t, GROUP_SIZE_M=g, num_warps=w, num_stages=s)
            if fits(cfg, elsize, smem):
                dist = abs(s - t["num_stages"]) + (w != t["num_warps"]) + (g != t["GROUP_SIZE_M"])
                vs.append((dist, cfg))
        per_tile.append([c for _, c in sorted(vs, key=lambda v: v[0])])
    return [c for group in itertools.zip_longest(*per_tile) for c in group if c is not None]


def is_fp8(w) -> bool:
    """FP8 experts travel as ``(e4m3 weights, block scales)`` pairs."""
    return isinstance(w, tuple)


class Interleaved(torch.Tensor):
    """Marks a ``w13`` whose gate/up rows are interleaved (``interleave_gate_up``), as the Triton MoE backend
    stores high-precision experts: the first GEMM then computes the activation in its epilogue."""


def interleaved(w13: torch.Tensor) -> torch.Tensor:
    return interleave_gate_up(w13).as_subclass(Interleaved)


def run_moe(x, w13, w2, topk_weights, topk_ids, cfg: dict, out=None) -> torch.Tensor:
    """The kernel being tuned: ``fused_moe`` as the engine calls it by default (interleaved gate/up rows where
    ``w13`` is marked so, steps of up to ``moe_pairwise_max_tokens`` tokens without the alignment), or
    ``fused_moe_fp8`` for FP8 experts."""
    if is_fp8(w13):
        return fused_moe_fp8(x, w13[0], w13[1], w2[0], w2[1], topk_weights, topk_ids, config=cfg, out=out)
    inter = isinstance(w13, Interleaved)
    return fused_moe(x, w13.as_subclass(torch.Tensor), w2, topk_weights, topk_ids, config=cfg, out=out,
                     interleaved=inter, pairwise_max_tokens=ENGINE_PAIRWISE_MAX_TOKENS if inter else 0)


def fp8_fits(cfg: dict) -> bool:
    """The FP8 kernel applies one weight scale per K tile: ``BLOCK_SIZE_K`` must divide 128."""
    return BLOCK % int(cfg["BLOCK_SIZE_K"]) == 0


def precompile(configs: list[dict], x, w13, w2, top_k: int, pool, timeout_s: float) -> int:
    """Compile both GEMM variants of each config in parallel, stopping after ``timeout_s``; returns #done
    (0 for FP8 experts, whose tiles compile when first timed)."""
    mode_cls = getattr(triton, "AsyncCompileMode", None)
    if mode_cls is None or not configs or is_fp8(w13):
        return 0
    with mode_cls(pool, ignore_errors=True) as mode:
        for cfg in configs:
            fused_moe_warmup(x, w13.as_subclass(torch.Tensor), w2, top_k, cfg,
                             interleaved=isinstance(w13, Interleaved))
        done, pending = cf.wait(list(mode.raw_futures), timeout=max(0.0, timeout_s))
        for f in pending:
            f.cancel()
    return len(done)


def make_routing(M: int, E: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random routing: ``k`` distinct experts per token and softmax-normalised weights."""
    ids = torch.rand(M, E, device=device).argsort(dim=1)[:, :top_k].to(torch.int32)
    weights = torch.softmax(torch.randn(M, top_k, device=device), dim=1)
    return weights, ids


def reference(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """fp32 per-expert reference of the fused MoE MLP; for FP8 experts, of the dequantised weights with the
    activations quantised per token group as the kernel does (the down projection's input too)."""
    fp8 = is_fp8(w13)
    if isinstance(w13, Interleaved):
        w13 = deinterleave_gate_up(w13.as_subclass(torch.Tensor))
    if fp8:
        w13, w2 = block_dequant_fp8(*w13), block_dequant_fp8(*w2)
        x = per_token_group_dequant(*per_token_group_quant_fp8(x))
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in range(w13.shape[0]):
        tok, slot = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        h = xf[tok] @ w13[e].float().T
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        if fp8:
            h = per_token_group_dequant(*per_token_group_quant_fp8(h.to(torch.bfloat16)))
        out.index_add_(0, tok, (h @ w2[e].float().T) * topk_weights[tok, slot, None])
    return out


def verify(cfg: dict, M: int, x_all, w13, w2, E: int, top_k: int) -> float:
    """Relative Frobenius error of ``fused_moe`` with ``cfg`` against the fp32 reference on fresh routing."""
    x = torch.randn_like(x_all[:M])
    tw, ti = make_routing(M, E, top_k, x.device)
    y = run_moe(x, w13, w2, tw, ti, cfg).float()
    ref = reference(x, w13, w2, tw, ti)
    return float((y - ref).norm() / ref.norm().clamp_min(1e-12))


def time_config(cfg: dict, x, w13, w2, routings) -> float:
    """Median microseconds per ``fused_moe`` call, replaying a CUDA graph of calls over varied routings."""
    out = torch.empty_like(x)
    run_moe(x, w13, w2, *routings[0], cfg, out=out)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(3):
        run_moe(x, w13, w2, *routings[i % len(routings)], cfg, out=out)
    end.record()
    end.synchronize()
    est_us = max(start.elapsed_time(end) * 1e3 / 3, 1.0)
    inner = int(min(32, max(1, round(TARGET_REPLAY_US / est_us))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(inner):
            run_moe(x, w13, w2, *routings[i % len(routings)], cfg, out=out)
    graph.replay()
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    del graph
    return statistics.median(times)


class Tuner:
    """Budgeted search over all (shape, M) pairs; see the module docstring."""

    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget_s
        self.dtype = DTYPES[args.dtype]
        self.fp8 = args.dtype == FP8_CONFIG_TAG
        self.elsize = 1 if self.fp8 else torch.empty((), dtype=self.dtype).element_size()
        self.smem = smem_limit()
        self.device = device_name()
        self.dev = torch.device("cuda")
        self.pool = cf.ThreadPoolExecutor(max_workers=args.compile_workers)
        self.summary = []

    def default(self, M: int, E: int, inter: int, H: int, top_k: int) -> dict:
        """The config the kernel would run untuned."""
        if self.fp8:
            return default_fp8_config(M, E, inter, H, top_k)
        return default_config(M, E, inter, H, top_k, self.dtype)

    def tiles(self, M: int, E: int, top_k: int, limit: int) -> list[dict]:
        tiles = tile_candidates(M, E, top_k, self.elsize, self.smem, self.dtype, limit if not self.fp8 else 2 * limit)
        return [c for c in tiles if fp8_fits(c)][:limit] if self.fp8 else tiles

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> str:
        return f"[{time.monotonic() - self.t0:6.1f}s]"

    def search_deadline(self, pairs_left: int) -> float:
        """Time this pair may search until: an even share of what is left, less the per-pair reserve."""
        spare = self.left() - SECONDS_PER_PAIR_RESERVE * pairs_left
        return time.monotonic() + max(0.0, spare / max(pairs_left, 1))

    def evaluate(self, cfgs, results, x, w13, w2, routings, until: float, force: bool = False) -> None:
        for cfg in cfgs:
            if cfg_key(cfg) in results:
                continue
            if not force and time.monotonic() > until:
                return
            try:
                results[cfg_key(cfg)] = (time_config(cfg, x, w13, w2, routings), cfg)
            except Exception as exc:
                results[cfg_key(cfg)] = (math.inf, cfg)
                log(f"    skip {cfg_str(cfg)}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")

    def tune_pair(self, M, E, inter, H, top_k, x_all, w13, w2, prev_best, pairs_left, current=None):
        """``(config, us, default's us, current's us, rel err, configs timed)``: the best config for ``M`` tokens;
        ``current``: the table's entry for ``M`` (timed first, with the default and the previous ``M``'s winner;
        nan without one)."""
        until = self.search_deadline(pairs_left)
        x = x_all[:M]
        routings = [make_routing(M, E, top_k, x.device) for _ in range(8)]
        default = self.default(M, E, inter, H, top_k)
        results: dict[tuple, tuple[float, dict]] = {}
        first = [default] + [c for c in (prev_best, current) if c]
        self.evaluate(first, results, x, w13, w2, routings, until, force=True)
        limit = self.args.max_candidates
        tiles = self.tiles(M, E, top_k, limit * 3 // 5)
        if time.monotonic() < until:
            precompile(tiles, x, w13, w2, top_k, self.pool, until - time.monotonic())
        self.evaluate(tiles, results, x, w13, w2, routings, until)
        ranked = sorted(results.values(), key=lambda r: r[0])
        best_tiles, seen = [], set()
        for _, cfg in ranked:
            tile = (cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"])
            if tile not in seen and len(best_tiles) < 2:
                seen.add(tile)
                best_tiles.append(cfg)
        room = max(0, limit - len(results))
        variants = [c for c in variant_candidates(best_tiles, M, E, top_k, self.elsize, self.smem)
                    if cfg_key(c) not in results and (not self.fp8 or fp8_fits(c))][:room]
        if variants and time.monotonic() < until:
            precompile(variants, x, w13, w2, top_k, self.pool, until - time.monotonic())
            self.evaluate(variants, results, x, w13, w2, routings, until)
        ranked = sorted(results.values(), key=lambda r: r[0])
        default_us = results[cfg_key(default)][0]
        current_us = results[cfg_key(current)][0] if current else math.nan
        for us, cfg in ranked[:3] + [(default_us, default)]:
            if not math.isfinite(us):
                continue
            err = verify(cfg, M, x_all, w13, w2, E, top_k)
            if err < (REL_ERR_LIMIT_FP8 if self.fp8 else REL_ERR_LIMIT):
                return cfg, us, default_us, current_us, err, len(results)
            log(f"    {cfg_str(cfg)} failed verification: rel err {err:.3g}")
        raise RuntimeError(f"no config passed verification for M={M}")

    def write(self, path: Path, table: dict[int, dict]) -> None:
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({str(m): table[m] for m in sorted(table)}, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)

    def run_shape(self, name, E, inter, H, top_k, shapes_left, pairs_left):
        args = self.args
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / config_file_name(E, inter, H, args.dtype, self.device, BLOCK_SHAPE if self.fp8 else None)
        table = parse_configs(json.loads(path.read_text())) if path.exists() else {}
        log(f"{self.elapsed()} shape {name}: E={E} I={inter} H={H} top_k={top_k} -> {path}")
        gen = torch.Generator(device=self.dev).manual_seed(args.seed)
        w13 = (torch.randn(E, 2 * inter, H, device=self.dev, generator=gen) / math.sqrt(H)).to(self.dtype)
        w2 = (torch.randn(E, H, inter, device=self.dev, generator=gen) / math.sqrt(inter)).to(self.dtype)
        if self.fp8:
            w13, w2 = block_quant_fp8(w13), block_quant_fp8(w2)
        elif not args.gate_then_up:
            w13 = interleaved(w13)
        x_all = torch.randn(max(args.batch_sizes), H, device=self.dev, generator=gen).to(self.dtype)

        per_m = [[self.default(M, E, inter, H, top_k)] + self.tiles(M, E, top_k, args.max_candidates * 3 // 5)
                 for M in args.batch_sizes]
        union, seen = [], set()
        for cfg in itertools.chain.from_iterable(itertools.zip_longest(*per_m)):
            if cfg is not None and cfg_key(cfg) not in seen:
                seen.add(cfg_key(cfg))
                union.append(cfg)
        cap = max(0.0, self.left() - SECONDS_PER_PAIR_RESERVE * pairs_left) * 0.3 / shapes_left
        t = time.monotonic()
        n = precompile(union, x_all[:1], w13, w2, top_k, self.pool, cap)
        log(f"{self.elapsed()}   precompiled {n}/{2 * len(union)} kernels in {time.monotonic() - t:.1f}s")

        prev = None
        for M in args.batch_sizes:
            cfg, us, default_us, table_us, err, tried = self.tune_pair(M, E, inter, H, top_k, x_all, w13, w2, prev,
                                                                       pairs_left, table.get(M))
            pairs_left -= 1
            prev = cfg
            table[M] = cfg
            self.write(path, table)
            self.summary.append((name, M, us, default_us, table_us, err, tried, cfg))
            log(f"{self.elapsed()}   M={M:5d} best {us:9.1f}us (default {default_us:9.1f}us, x{default_us / us:.2f}; "
                f"table's {table_us:9.1f}us) {cfg_str(cfg)} err={err:.2e} tried={tried}")
        del w13, w2, x_all
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        return pairs_left

    def run(self, shapes: list[tuple[str, tuple[int, int, int, int]]]) -> None:
        pairs_left = len(shapes) * len(self.args.batch_sizes)
        log(f"tuning {len(shapes)} shape(s) x {len(self.args.batch_sizes)} batch sizes on {self.device}, "
            f"budget {self.args.budget_s:.0f}s, smem {self.smem} B, {self.args.compile_workers} compile workers")
        for i, (name, (E, inter, H, top_k)) in enumerate(shapes):
            pairs_left = self.run_shape(name, E, inter, H, top_k, len(shapes) - i, pairs_left)
        self.pool.shutdown(wait=False, cancel_futures=True)
        log(f"\n{'shape':>10} {'M':>5} {'best_us':>10} {'default_us':>10} {'speedup':>7} {'table_us':>10} "
            f"{'rel_err':>8} {'tried':>5}  config")
        for name, M, us, dus, tus, err, tried, cfg in self.summary:
            log(f"{name:>10} {M:5d} {us:10.1f} {dus:10.1f} {dus / us:7.2f} {tus:10.1f} {err:8.1e} {tried:5d}  "
                f"{cfg_str(cfg)}")
        log(f"total {time.monotonic() - self.t0:.1f}s (budget {self.args.budget_s:.0f}s)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", default=[], choices=sorted(SHAPES), help="named model shapes")
    p.add_argument("--shape", action="append", default=[], metavar="E,I,H,TOPK", help="an extra shape")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=BATCH_SIZES)
    p.add_argument("--out", default=str(CONFIG_DIR), help="output directory (default: the package configs/)")
    p.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget for everything")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--max-candidates", type=int, default=40, help="configs timed per batch size at most")
    p.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gate-then-up", action="store_true",
                   help="bf16/fp16: time the gate-then-up layout with a separate activation kernel instead of the "
                   "interleaved rows the engine stores (the activation in the first GEMM's epilogue)")
    args = p.parse_args(argv)
    shapes = [(n, SHAPES[n]) for n in args.shapes]
    for s in args.shape:
        E, inter, H, k = (int(v) for v in s.split(","))
        shapes.append((f"E{E}I{inter}", (E, inter, H, k)))
    if not shapes:
        p.error("give --shapes and/or --shape")
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args, shapes


def main(argv=None) -> None:
    args, shapes = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_triton needs a CUDA GPU")
    torch.manual_seed(args.seed)
    Tuner(args).run(shapes)


if __name__ == "__main__":
    main()
