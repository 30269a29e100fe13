"""A one-token step's attention half at Qwen1.5-MoE's shapes on one GPU, timed as a step runs it: 24 layers (each
with its own weights and KV cache, more than the L2 caches hold) back to back in one CUDA graph with programmatic
dependent launch, as the persistent kernel (``moeserve.ops.attention.layer_triton``) and as the kernels it
replaces (FlashInfer's fused add + RMSNorm, the GEMV, the one-kernel Triton decode attention, the GEMV, add +
RMSNorm, the router's split-K partial sums), and as those kernels with the QKV GEMV and the decode attention in one
grid (``moeserve.ops.attention.qkv_gemv_triton``), once for each ``--grid`` setting of its knobs (JSON objects of
its module constants; by default its form, 8 splits at most, four programs an SM, the one-row GEMV). Prints
microseconds per layer and the persistent kernel's
registers, spills and shared memory; for each ``--variant`` of the kernel's tiles and options (JSON objects
over ``layer_triton.layer_config``), its time and where it goes: each program's cycle counter at the phase
boundaries (its wait for the kernel before, each phase's work, each barrier), read from the last replay and
converted at ``--sm-mhz``.

    python scripts/layer_kernel_bench.py [--context 560] [--layers 24] [--replays 50] [--variant JSON ...]
        [--grid JSON ...] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=560)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--variant", action="append", default=[], help='e.g. {"num_warps": 8} or {"O_PRE": 0}')
    p.add_argument("--sm-mhz", type=float, default=1980.0, help="SM clock for cycles to microseconds")
    p.add_argument("--grid", action="append", default=[],
                   help='qkv_gemv_triton constants, e.g. {"TILES": "row"} (default: {}, 8 splits, FOUR_PER_SM, row)')
    p.add_argument("--out")
    a = p.parse_args()
    import flashinfer

    from moeserve.ops import pdl
    from moeserve.ops.attention import qkv_gemv_triton as qg
    from moeserve.ops.attention.decode_triton import DecodeWorkspace, qkv_decode_attention
    from moeserve.ops.attention.layer_triton import (LayerWorkspace, attention_half, attention_half_kernel,
                                                     layer_config)
    from moeserve.ops.basic import rope_cos_sin_cache
    from moeserve.ops.linear_triton import gemv
    from moeserve.ops.moe.routing_triton import router_partials
    dev, bf = torch.device("cuda"), torch.bfloat16
    h, hq, hkv, d, page, eps = 2048, 16, 16, 128, 16, 1e-6
    nqkv = (hq + 2 * hkv) * d
    pages = -(-(a.context + 1) // page)
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, s=0.02):
        return (torch.randn(*shape, generator=g, device=dev) * s).to(bf)

    layers = [dict(wqkv=rnd(nqkv, h), b=rnd(nqkv), wo=rnd(h, hq * d), n1=rnd(h, s=1.0), n2=rnd(h, s=1.0),
                   router=rnd(64, h), cache=rnd(pages + 1, 2, page, hkv, d, s=1.0)) for _ in range(a.layers)]
    i32 = dict(dtype=torch.int32, device=dev)
    pos = torch.tensor([a.context], **i32)
    indices = torch.randperm(pages, device=dev).add(1).to(torch.int32)
    indptr = torch.tensor([0, pages], **i32)
    cos_sin = rope_cos_sin_cache(d, 4096, 1e6, None, dev)
    hidden, residual = rnd(1, h, s=1.0), rnd(1, h, s=1.0)
    lws = LayerWorkspace(h, hq, hkv, d, bf, dev)
    dws = DecodeWorkspace(32, hq, hkv, d, dev)
    scale = d ** -0.5

    base = layer_config(h, nqkv, hq * d, lws.num_sms)
    timing = torch.zeros((a.layers, lws.num_sms, 8), dtype=torch.int64, device=dev)

    def fused(config=None, timed=False):
        def run():
            for i, L in enumerate(layers):
                attention_half(hidden, residual, L["n1"], L["wqkv"], L["b"], L["wo"], L["n2"], eps, pos, cos_sin, hq,
                               hkv, d, L["cache"], pos, indices, indptr, None, None, eps, scale, lws,
                               router=L["router"], config=config, timing=timing[i] if timed else None)
        return run

    def unfused():
        for L in layers:
            flashinfer.fused_add_rmsnorm(hidden, residual, L["n1"], eps)  # in place, as the engine runs it
            qkv = gemv(hidden, L["wqkv"], L["b"])
            o = qkv_decode_attention(qkv, pos, cos_sin, hq, hkv, d, L["cache"], pos, indices, indptr, None, None, eps,
                                     scale, dws)
            y = gemv(o.view(1, -1), L["wo"])
            flashinfer.fused_add_rmsnorm(y, residual, L["n2"], eps)
            router_partials(y, L["router"])

    def unfused_grid(knobs):
        """The kernels of ``unfused``, the QKV GEMV and the attention as one grid with ``knobs`` set (they are read as
        the grid launches: at the warm-up and the capture)."""
        def run():
            saved = {k: getattr(qg, k) for k in knobs}
            for k, v in knobs.items():
                setattr(qg, k, v)
            try:
                for L in layers:
                    flashinfer.fused_add_rmsnorm(hidden, residual, L["n1"], eps)
                    o = qg.qkv_gemv_decode_attention(hidden, L["wqkv"], L["b"], pos, cos_sin, hq, hkv, d, L["cache"],
                                                     pos, indices, indptr, None, None, eps, scale, dws)
                    y = gemv(o.view(1, -1), L["wo"])
                    flashinfer.fused_add_rmsnorm(y, residual, L["n2"], eps)
                    router_partials(y, L["router"])
            finally:
                for k, v in saved.items():
                    setattr(qg, k, v)
        return run

    def time_graph(fn):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(5):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / a.replays / a.layers

    def phases():
        c = timing.double() / a.sm_mhz  # microseconds at the given clock, [layers, programs, 8]
        d_ = c[:, :, 1:] - c[:, :, :-1]
        names = ["wait for the kernel before", "phase 0 work (norm, QKV)", "loads ahead + barrier 1",
                 "phase 1 work (attention, merge)", "loads ahead + barrier 2", "phase 2 work (output projection)",
                 "loads ahead + barrier 3"]
        return {n: {"mean": d_[:, :, k].mean().item(), "max": d_[:, :, k].amax(1).mean().item(),
                    "min": d_[:, :, k].amin(1).mean().item()} for k, n in enumerate(names)}

    res, breakdown = {}, {}
    variants = [("default", {})] + [(v, json.loads(v)) for v in a.variant]
    with pdl.enabled_as(64):
        res["kernel by kernel"] = time_graph(unfused)
        grids = [json.loads(g) for g in a.grid] or [{}, {"MAX_SPLITS_IN_GRID": 8}, {"FOUR_PER_SM": True},
                                                     {"TILES": "row"}]
        for knobs in grids:
            res[f"QKV + attention grid {json.dumps(knobs)}"] = time_graph(unfused_grid(knobs))
        for name, extra in variants:
            cfg = {**base, **extra}
            res[f"persistent {name}"] = time_graph(fused(cfg))
            time_graph(fused(cfg, timed=True))
            breakdown[name] = phases()
    info = {}
    try:
        for k in attention_half_kernel.device_caches[0][0].values():
            info = {"n_regs": k.n_regs, "n_spills": k.n_spills, "shared": k.metadata.shared}
    except Exception as e:  # noqa: BLE001 (a report, not a check)
        info = {"error": repr(e)}
    out = {"context": a.context, "layers": a.layers, "us_per_layer": res, "kernel": info, "phases": breakdown,
           "base_config": base,
           "gpu": torch.cuda.get_device_name(), "sms": lws.num_sms, "splits": lws.nsplit}
    for name, us in res.items():
        print(f"{name:>40}: {us:7.2f} us per layer")
    for name, ph in breakdown.items():
        print(f"-- {name}: per program, us (mean / slowest / fastest program, averaged over layers)")
        for k, v in ph.items():
            print(f"   {k:>40}: {v['mean']:6.2f} / {v['max']:6.2f} / {v['min']:6.2f}")
    print(json.dumps(out))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
