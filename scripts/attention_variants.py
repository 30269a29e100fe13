"""Decode attention on FlashInfer's kernels, variant by variant, as a decode step runs it: one CUDA graph of a
call per layer (each layer its own KV cache, so nothing is served from L2), replayed; µs per layer and the KV
cache's read rate. Every variant's output is checked against the CUDA-core decode wrapper's (the engine's
default) on the same random cache.

Variants: ``decode`` (CUDA-core decode, the engine's), ``decode-nosplit`` (the same without split-KV),
``decode-tc`` (tensor-core decode: FlashInfer's FA2 prefill kernels, JIT-compiled when not in the kernel
cache), ``fa3`` (the paged FA3 prefill wrapper with one query per request), ``xqa`` (TensorRT-LLM's XQA decode
kernel through ``flashinfer.decode.xqa_batch_decode_with_kv_cache``; JIT-compiled), each at every page size
given. Two more run the whole attention of a decode layer from its QKV projection: ``qkv+decode`` (the
engine's QKV kernel, then the CUDA-core decode; ``qkv+decode-tc`` with the tensor-core decode, which the
engine takes for GQA groups of 4 or more) and ``triton`` (the one-kernel
decode of ``moeserve.ops.attention.decode_triton``; ``triton:B:W@N`` runs it with B keys per iteration, W warps,
and the split count it picks for a GPU of N SMs),
checked against ``qkv+decode``; both write the new token's key and value into the last slot of each request.

    python scripts/attention_variants.py --batch 1 8 32 64 --context 560 --page-size 16 64 --out attn.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from moeserve.bench.graph_timing import time_in_graph_us

TOL = 2e-2  # bf16 outputs of two float32-accumulated softmax(QK^T)V over the same cache


def make_cache(layers, batch, context, page_size, heads, head_dim, dtype, gen):
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq + 1  # page 0 reserved, as in the engine
    data = torch.randn(layers, num_pages, 2, page_size, heads, head_dim, dtype=dtype, device="cuda", generator=gen)
    perm = torch.randperm(num_pages - 1, device="cuda", generator=gen).to(torch.int32) + 1
    table = perm.view(batch, pages_per_seq)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages_per_seq
    last = context - (pages_per_seq - 1) * page_size
    last_page_len = torch.full((batch,), last, dtype=torch.int32, device="cuda")
    return data, table, indptr, last_page_len


def graph_time_us(step, layers: int, replays: int = 30) -> float:
    """µs per layer of one graph of ``step(layer)`` for every layer, replayed."""
    return time_in_graph_us([lambda layer=layer: step(layer) for layer in range(layers)], replays, warm_replays=3)


def save(path: str | None, rows: list) -> None:
    if path:
        import flashinfer
        with open(path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__,
                       "torch": torch.__version__, "rows": rows}, f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--context", type=int, default=560)
    p.add_argument("--page-size", type=int, nargs="+", default=[16])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--variants", nargs="+", default=["decode", "decode-nosplit", "fa3", "xqa", "decode-tc"])
    p.add_argument("--budget", type=float, default=1e9, help="seconds: variants not started by then are skipped")
    p.add_argument("--kernel-cache", default=None, help="a kernel cache made by moeserve precompile")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_variants: needs a CUDA GPU")
        return 2
    if args.kernel_cache:  # FlashInfer's modules from a `moeserve precompile` cache; the rest compile here
        from moeserve.hardware import probe
        from moeserve.kernel_cache import use_kernel_cache
        use_kernel_cache(args.kernel_cache, probe())
    import flashinfer
    from flashinfer.decode import xqa_batch_decode_with_kv_cache

    t0 = time.time()
    dtype = torch.bfloat16
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    scale = d ** -0.5
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    xqa_ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for ps in args.page_size:
        for b in args.batch:
            data, table, indptr, last = make_cache(args.layers, b, args.context, ps, hkv, d, dtype, gen)
            indices = table.reshape(-1).contiguous()
            q = torch.randn(b, hq, d, dtype=dtype, device="cuda", generator=gen)
            kv_bytes = b * args.context * 2 * hkv * d * 2
            outs = {}
            qkv = torch.randn(b, (hq + 2 * hkv) * d, dtype=dtype, device="cuda", generator=gen)
            pos = torch.full((b,), args.context - 1, dtype=torch.int32, device="cuda")
            bidx = torch.arange(b, dtype=torch.int32, device="cuda")  # (the QKV kernel's batch indices)
            cos_sin = torch.randn(args.context, d, dtype=torch.float32, device="cuda", generator=gen)
            qkv_args = (qkv, pos, cos_sin, hq, hkv, d)

            def decode_wrapper(tc: bool, nosplit: bool):
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_cuda_graph=True, use_tensor_cores=tc, paged_kv_indptr_buffer=indptr.clone(),
                    paged_kv_indices_buffer=indices.clone(), paged_kv_last_page_len_buffer=last.clone())
                w.plan(indptr.cpu(), indices, last.cpu(), hq, hkv, d, ps, q_data_type=dtype, kv_data_type=dtype,
                       sm_scale=scale, disable_split_kv=nosplit)
                return w

            for name in args.variants:
                if time.time() - t0 > args.budget:
                    print(f"skip {name} ps={ps} b={b}: budget")
                    continue
                out = torch.empty(args.layers, b, hq, d, dtype=dtype, device="cuda")
                t1 = time.time()
                try:
                    if name in ("decode", "decode-nosplit", "decode-tc"):
                        w = decode_wrapper(name == "decode-tc", name == "decode-nosplit")
                        step = lambda i, w=w: w.run(q, data[i], out=out[i])  # noqa: E731
                    elif name == "fa3":
                        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")
                        qo = torch.arange(b + 1, dtype=torch.int32)
                        w.plan(qo, indptr.cpu(), indices, last.cpu(), hq, hkv, d, ps, causal=True,
                               q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
                        step = lambda i, w=w: w.run(q, data[i], out=out[i])  # noqa: E731
                    elif name == "xqa":
                        seq = torch.full((b,), args.context, dtype=torch.uint32, device="cuda")
                        step = lambda i: xqa_batch_decode_with_kv_cache(  # noqa: E731
                            q, data[i], xqa_ws, table, seq, args.context, bmm1_scale=scale, bmm2_scale=1.0,
                            out=out[i], kv_layout="NHD")
                    elif name in ("qkv+decode", "qkv+decode-tc"):
                        from moeserve.ops.attention.qkv_triton import qkv_rope_append
                        w = decode_wrapper(name.endswith("-tc"), False)
                        qbuf = torch.empty(b, hq, d, dtype=dtype, device="cuda")

                        def step(i, w=w, qbuf=qbuf):
                            qkv_rope_append(*qkv_args, data[i], bidx, pos, indices, indptr, out=qbuf)
                            w.run(qbuf, data[i], out=out[i])
                    elif name.startswith("triton"):
                        from moeserve.ops.attention.decode_triton import DecodeWorkspace, qkv_decode_attention
                        # triton[:BLOCK[:WARPS[:STAGES]]][@SMS][-nomerge]
                        merge = not name.endswith("-nomerge")
                        spec, _, sms = name.removesuffix("-nomerge").partition("@")
                        knobs = list(map(int, spec.split(":")[1:]))
                        block, warps, stages = knobs + [64, 2, 2][len(knobs):]
                        tws = DecodeWorkspace(b, hq, hkv, d, torch.device("cuda"), num_sms=int(sms) if sms else None)
                        step = lambda i, tws=tws, bl=block, nw=warps, ns=stages, mg=merge: qkv_decode_attention(  # noqa
                            *qkv_args, data[i], pos, indices, indptr, None, None, 1e-6, scale, tws, out=out[i],
                            block=bl, num_warps=nw, num_stages=ns, merge=mg)
                    else:
                        raise ValueError(name)
                    step(0)
                    torch.cuda.synchronize()
                    first = time.time() - t1
                    us = graph_time_us(step, args.layers)
                except Exception as e:  # a variant this GPU/build cannot run is reported, not fatal
                    msg = str(e).strip().splitlines()
                    print(f"{name:15s} ps={ps:3d} b={b:3d}: failed: {type(e).__name__}: {msg[-1] if msg else ''}"[:300])
                    rows.append({"variant": name, "page_size": ps, "batch": b,
                                 "error": f"{type(e).__name__}: {e}"[:2000]})
                    continue
                outs[name] = out
                # the triton variants against the layer they replace; FlashInfer's others against its decode
                ref = (outs.get("qkv+decode") if name.startswith("triton") or name == "qkv+decode-tc"
                       else None if name == "qkv+decode" else outs.get("decode"))
                err = (out.float() - ref.float()).abs().max().item() if ref is not None else 0.0
                if name.endswith("-nomerge"):  # writes no output where it splits: timing only
                    err = 0.0
                row = {"variant": name, "page_size": ps, "batch": b, "context": args.context, "us_per_layer": us,
                       "kv_tbps": kv_bytes / us / 1e6, "max_abs_err_vs_decode": err, "first_call_s": first,
                       "ok": err <= TOL}
                rows.append(row)
                save(args.out, rows)  # as it goes: a variant that hangs in its compile loses nothing before it
                print(f"{name:15s} ps={ps:3d} b={b:3d}: {us:7.2f} us/layer  KV {row['kv_tbps']:.2f} TB/s  "
                      f"err {err:.1e}{'' if row['ok'] else ' MISMATCH'}  (first call {first:.1f} s)", flush=True)
            outs.clear()
    save(args.out, rows)
    print("\nvariant          ps  " + "  ".join(f"b={b:<5d}" for b in args.batch) + "  (us per layer)")
    for name in args.variants:
        for ps in args.page_size:
            cells = []
            for b in args.batch:
                r = [x for x in rows if x["variant"] == name and x["page_size"] == ps and x["batch"] == b]
                cells.append(f"{r[0]['us_per_layer']:7.2f}" if r and "us_per_layer" in r[0] else "      -")
            print(f"{name:15s} {ps:3d}  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
