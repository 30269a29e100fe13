"""``moeserve bench kernels``: the attention and MoE kernels on the configured model's shapes, each checked
against the torch reference and then timed.

Kernels: FlashInfer paged decode on CUDA cores and on tensor cores, FlashInfer paged prefill with FA2
and FA3 (sm90), TensorRT-LLM's XQA decode (``trtllm_batch_decode_with_kv_cache(backend="xqa")``, sm90,
sm100, sm120) and its trtllm-gen decode (sm100); MoE: FlashInfer's ``cutlass_fused_moe`` (TensorRT-LLM
grouped GEMMs; its first weight wants the up rows before the gate rows), moeserve's Triton fused MoE
and the torch reference. Decode runs at each batch size with the benchmark's mean decode context
(prompt + output/2); prefill and MoE-prefill use ``c * prompt_len`` tokens, capped at one scheduler
step (``max_num_batched_tokens``).

Correctness: each kernel's output on fresh random inputs must satisfy
``max|out - ref| <= tol * max|ref|`` against the float32 torch reference (tol 2e-2 for attention,
3e-2 for MoE, bf16 inputs). Timing: ``flashinfer.testing.bench_gpu_time`` with a cold L2
(rotating input copies under CUDA graphs; an L2 flush between launches otherwise), CUDA graphs for
decode and MoE kernels that allow capture, median over the runs. A kernel that cannot run here is
listed as skipped with the reason; one that fails is listed as failed and the rest still run.
"""
from __future__ import annotations

import re
import sys
import time
import traceback

import torch

from moeserve.bench.kernel_cases import (ATTN_TOL, KERNELS, MOE_TOL, WORKSPACE_BYTES, Shapes, attention_reference,
                                         attention_traffic, cuda_alive, cutlass_moe, fi_decode, fi_prefill, measure,
                                         moe_inputs, moe_traffic, moe_weights, paged_inputs, skip_reason,
                                         torch_moe_kernel, triton_moe, trtllm_decode)

# --- the run ---------------------------------------------------------------------------------------

def plan_batches(args, cfg) -> tuple[list[int], list[int]]:
    """(decode batch sizes, prefill batch sizes)."""
    batches = sorted(set(args.batch_sizes or cfg.bench.concurrency))
    if args.quick:
        batches = sorted({batches[0], batches[-1]})
        return batches, [batches[-1]]
    return batches, batches


def shapes_for(cfg, arch, dtype) -> Shapes:
    return Shapes(arch.num_heads, arch.num_kv_heads, arch.head_dim, cfg.page_size, arch.num_experts,
                  arch.moe_intermediate_size, arch.hidden_size, arch.top_k, dtype,
                  int(cfg.bench.prompt_len + cfg.bench.output_len // 2), cfg.bench.prompt_len,
                  cfg.max_num_batched_tokens)


def _row(name: str, op: str, shape: str, batch: int, tokens: int) -> dict:
    return {"kernel": name, "op": op, "shape": shape, "batch": batch, "tokens": tokens, "status": "pending"}


def run_rows(cfg, arch, dtype, device, cap: tuple[int, int], batches, prefill_batches, args, log, save) -> list[dict]:
    """Check and time every kernel at every size; ``save(rows)`` after each one (partial results)."""
    from moeserve.kernel_cache import clear_jit_events, jit_events
    sh = shapes_for(cfg, arch, dtype)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    xqa_ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    attn = f"Hq={sh.num_heads} Hkv={sh.num_kv_heads} D={sh.head_dim} page={sh.page_size}"
    moe = f"E={sh.num_experts} I={sh.intermediate} H={sh.hidden} k={sh.top_k} {str(sh.dtype)[6:]}"
    cache: dict = {}

    def lazy(key, make):
        """Inputs and references are made once, on first use, and shared by every kernel."""
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def steps_in_prefill(b):
        return max(1, min(b, sh.max_step_tokens // sh.prompt_len))

    def decode_in(b):
        return lazy(("d", b), lambda: paged_inputs(sh, b, sh.context_len, 1, device, gen))

    def prefill_in(b):
        return lazy(("p", b), lambda: paged_inputs(sh, steps_in_prefill(b), sh.prompt_len, sh.prompt_len, device, gen))

    def weights():
        return lazy("w", lambda: moe_weights(sh, device, gen))

    def moe_in(t):
        return lazy(("m", t), lambda: moe_inputs(sh, t, arch.routing, device, gen))

    def moe_ref(t):
        from moeserve.ops.moe.torch_ref import torch_moe
        w, i = weights(), moe_in(t)
        return lazy(("mr", t), lambda: torch_moe(i["x"].float(), w["w13_f"], w["w2_f"], i["weights"], i["ids"]))

    work = []
    for name, op, needs in KERNELS:
        if op == "attention-decode":
            maker = {"flashinfer decode (CUDA cores)": lambda i: fi_decode(sh, i, ws, False),
                     "flashinfer decode (tensor cores)": lambda i: fi_decode(sh, i, ws, True),
                     "trtllm xqa decode": lambda i: trtllm_decode(sh, i, xqa_ws, "xqa"),
                     "trtllm-gen decode": lambda i: trtllm_decode(sh, i, xqa_ws, "trtllm-gen")}[name]
            for b in batches:
                work.append((_row(name, op, f"{attn} ctx={sh.context_len}", b, b), needs,
                             lambda b=b, m=maker: (lambda: m(decode_in(b)),
                                                   lazy(("dr", b), lambda: attention_reference(sh, decode_in(b))),
                                                   ATTN_TOL, attention_traffic(sh, decode_in(b)))))
        elif op == "attention-prefill":
            backend = "fa3" if name.endswith("fa3") else "fa2"
            for b in prefill_batches:
                n = steps_in_prefill(b)
                work.append((_row(name, op, f"{attn} {n}x{sh.prompt_len} causal", b, n * sh.prompt_len), needs,
                             lambda b=b, be=backend: (lambda: fi_prefill(sh, prefill_in(b), ws, be),
                                                      lazy(("pr", b), lambda: attention_reference(sh, prefill_in(b))),
                                                      ATTN_TOL, attention_traffic(sh, prefill_in(b)))))
        else:
            maker = {"moeserve triton fused_moe": triton_moe, "torch reference moe": torch_moe_kernel,
                     "flashinfer cutlass_fused_moe": cutlass_moe}[name]
            sizes = [(b, b) for b in batches]
            sizes += [(b, min(b * sh.prompt_len, sh.max_step_tokens)) for b in prefill_batches]
            for b, t in sizes:
                work.append((_row(name, op + ("-prefill" if t > b else "-decode"), moe, b, t), needs,
                             lambda t=t, m=maker: (lambda: m(sh, moe_in(t), weights()), moe_ref(t), MOE_TOL,
                                                   moe_traffic(sh, moe_in(t)))))
    from moeserve.bench import kernels_mixed as km

    def mixed_in(b):
        return lazy(("x", b), lambda: km.mixed_inputs(sh, b, device, gen))

    for name, needs in km.MIXED_KERNELS:
        for b in batches:
            work.append((_row(name, "attention-mixed", f"{attn} 1x{sh.prompt_len} + {b} decodes ctx={sh.context_len}",
                              b, sh.prompt_len + b), needs,
                         lambda b=b, mk=km.maker(name, sh, ws): (
                             lambda: mk(mixed_in(b)), lazy(("xr", b), lambda: km.mixed_reference(sh, mixed_in(b))),
                             ATTN_TOL, km.mixed_traffic(sh, mixed_in(b)))))
    rows, t0, lost = [], time.monotonic(), None
    wanted = getattr(args, "kernels", None)
    for row, needs, prepare in work:
        rows.append(row)
        if wanted and not re.search(wanted, row["kernel"], re.IGNORECASE):
            why = lost or f"not selected by --kernels {wanted!r}"
        else:
            why = lost or skip_reason(needs, cap, args.allow_slow_jit)
        if why is None and args.time_budget is not None and time.monotonic() - t0 > args.time_budget:
            why = f"--time-budget of {args.time_budget:.0f} s used up"
        if why is not None:
            row.update(status="skipped", reason=why)
            continue
        clear_jit_events()
        try:
            make, ref, tol, (moved, flops) = prepare()
            measure(make, ref, tol, row)
            row["gbps"] = moved / (row["time_us"] * 1e-6) / 1e9
            row["tflops"] = flops / (row["time_us"] * 1e-6) / 1e12
        except Exception as e:
            row.update(status="failed", reason=f"{type(e).__name__}: {str(e)[:300]}",
                       traceback=traceback.format_exc(limit=6))
            if not cuda_alive(device):
                lost = f"not run: the CUDA context was lost when {row['kernel']} (batch {row['batch']}) failed"
        row["jit"] = jit_events()
        log(f"{row['kernel']:<34} batch={row['batch']:<3} {row['status']:<8} "
            + (f"{row['time_us']:9.1f} us  err {row['max_error']:.1e}" if "time_us" in row else row.get("reason", "")))
        save(rows)
    return rows


def run(args) -> int:
    from moeserve.bench.common import base_result, output_dir, resolve_config, say
    from moeserve.bench.report import print_result, write_json, write_result
    t0 = time.monotonic()
    log = say(t0)
    if getattr(args, "kernels", None):
        try:
            re.compile(args.kernels)
        except re.error as e:
            print(f"moeserve bench kernels: --kernels {args.kernels!r} is not a regular expression: {e}",
                  file=sys.stderr)
            return 2
    cfg, choice = resolve_config(args)
    log(f"bench kernels: {choice}")
    hw_cuda = torch.cuda.is_available()
    if hw_cuda and cfg.kernel_cache_dir:
        from moeserve.hardware import probe
        from moeserve.kernel_cache import KernelCacheError, use_kernel_cache
        try:
            use_kernel_cache(cfg.kernel_cache_dir, probe())
        except KernelCacheError as e:
            log(f"kernel cache not used: {e}")
    result, source, arch, device, dtype = base_result("kernels", cfg, choice)
    out = output_dir(cfg, args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    batches, prefill_batches = plan_batches(args, cfg)
    result["kernel_settings"] = {"decode_batches": batches, "prefill_batches": prefill_batches,
                                 "attention_tolerance": ATTN_TOL, "moe_tolerance": MOE_TOL}
    if device.type != "cuda":
        reason = f"needs a CUDA GPU; this run is on {device}" + ("" if hw_cuda else " (no GPU here)")
        log("bench kernels: no CUDA GPU here; every kernel is skipped")
        from moeserve.bench.kernels_mixed import MIXED_KERNELS
        names = [(n, op) for n, op, _ in KERNELS] + [(n, "attention-mixed") for n, _ in MIXED_KERNELS]
        result["kernels"] = [dict(_row(n, op, "-", b, b), status="skipped", reason=reason)
                             for n, op in names for b in batches]
    else:
        if dtype not in (torch.bfloat16, torch.float16):
            log(f"bench kernels: {dtype} is not a kernel dtype here; using bfloat16")
            dtype = torch.bfloat16
        partial = out / "kernels.partial.json"
        cap = torch.cuda.get_device_capability(device)
        result["kernels"] = run_rows(cfg, arch, dtype, device, cap, batches, prefill_batches, args, log,
                                     lambda rows: write_json(dict(result, kernels=rows), partial))
        partial.unlink(missing_ok=True)
    result["wall_seconds"] = time.monotonic() - t0
    paths = write_result(result, out, "kernels")
    print_result(result)
    log("wrote " + ", ".join(paths.values()))
    return 0
