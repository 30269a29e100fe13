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
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_TOL = 2e-2
MOE_TOL = 3e-2
WORKSPACE_BYTES = 256 << 20
CUTLASS_MOE_ARCHS = {(8, 9): "89", (9, 0): "90", (10, 0): "100", (10, 3): "103", (12, 0): "120"}
KERNELS = (  # (name, op, needs)
    ("flashinfer decode (CUDA cores)", "attention-decode", "any"),
    ("flashinfer decode (tensor cores)", "attention-decode", "any"),
    ("flashinfer prefill fa2", "attention-prefill", "any"),
    ("flashinfer prefill fa3", "attention-prefill", "sm90"),
    ("moeserve triton fused_moe", "moe", "any"),
    ("torch reference moe", "moe", "any"),
    ("trtllm xqa decode", "attention-decode", "xqa"),
    ("trtllm-gen decode", "attention-decode", "sm100"),
    ("flashinfer cutlass_fused_moe", "moe", "cutlass"),
)


@dataclass
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_experts: int
    intermediate: int
    hidden: int
    top_k: int
    dtype: torch.dtype
    context_len: int
    prompt_len: int
    max_step_tokens: int

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


# --- inputs and references -------------------------------------------------------------------------

def paged_inputs(sh: Shapes, batch: int, kv_len: int, q_len: int, device, gen) -> dict:
    """``batch`` requests of ``kv_len`` cached tokens (the last ``q_len`` of them are the queries) on
    shuffled pages of a NHD paged cache, with FlashInfer's CSR indices and a block table."""
    pages_per_seq = -(-kv_len // sh.page_size)
    num_pages = batch * pages_per_seq + 1
    kv = torch.randn(num_pages, 2, sh.page_size, sh.num_kv_heads, sh.head_dim, generator=gen, device=device,
                     dtype=torch.float32).to(sh.dtype)
    order = (torch.randperm(num_pages - 1, generator=gen, device=device) + 1).to(torch.int32)
    q = torch.randn(batch * q_len, sh.num_heads, sh.head_dim, generator=gen, device=device).to(sh.dtype)
    last = kv_len - (pages_per_seq - 1) * sh.page_size
    return {"batch": batch, "kv_len": kv_len, "q_len": q_len, "q": q, "kv": kv, "indices": order,
            "indptr_host": torch.arange(batch + 1, dtype=torch.int32) * pages_per_seq,
            "qo_indptr_host": torch.arange(batch + 1, dtype=torch.int32) * q_len,
            "last_host": torch.full((batch,), last, dtype=torch.int32),
            "block_tables": order.view(batch, pages_per_seq),
            "seq_lens": torch.full((batch,), kv_len, dtype=torch.int32, device=device)}


def attention_reference(sh: Shapes, inp: dict) -> torch.Tensor:
    """float32 causal attention of each request's queries over its paged keys and values."""
    b, n, qn = inp["batch"], inp["kv_len"], inp["q_len"]
    kv = inp["kv"][inp["block_tables"].long()].float()  # [B, P, 2, page, Hkv, D]
    keys = kv[:, :, 0].reshape(b, -1, sh.num_kv_heads, sh.head_dim)[:, :n]
    vals = kv[:, :, 1].reshape(b, -1, sh.num_kv_heads, sh.head_dim)[:, :n]
    group = sh.num_heads // sh.num_kv_heads
    keys, vals = keys.repeat_interleave(group, dim=2), vals.repeat_interleave(group, dim=2)
    q = inp["q"].float().view(b, qn, sh.num_heads, sh.head_dim)
    mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - qn, n, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                                         attn_mask=mask, scale=sh.scale)
    return out.transpose(1, 2).reshape(b * qn, sh.num_heads, sh.head_dim)


def moe_inputs(sh: Shapes, tokens: int, routing, device, gen) -> dict:
    from moeserve.ops.moe.routing import select_experts
    x = torch.randn(tokens, sh.hidden, generator=gen, device=device).to(sh.dtype)
    logits = torch.randn(tokens, sh.num_experts, generator=gen, device=device)
    weights, ids = select_experts(logits, routing)
    return {"tokens": tokens, "x": x, "weights": weights, "ids": ids}


def moe_weights(sh: Shapes, device, gen) -> dict:
    e, i, h = sh.num_experts, sh.intermediate, sh.hidden
    w13 = (torch.randn(e, 2 * i, h, generator=gen, device=device) * h ** -0.5).to(sh.dtype)
    w2 = (torch.randn(e, h, i, generator=gen, device=device) * i ** -0.5).to(sh.dtype)
    return {"w13": w13, "w2": w2, "w13_f": w13.float(), "w2_f": w2.float()}


# --- the kernels: each returns (fn, args, use_cuda_graph) with fn(*args) -> output ----------------------

def _flashinfer():
    from moeserve.ops import flashinfer_env  # noqa: F401  (before flashinfer: env and JIT hook)
    import flashinfer
    return flashinfer


def fi_decode(sh, inp, ws, tensor_cores: bool):
    fi = _flashinfer()
    b, dev = inp["batch"], inp["q"].device
    w = fi.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=torch.empty(b + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buffer=torch.empty(inp["indices"].numel(), dtype=torch.int32, device=dev),
        paged_kv_last_page_len_buffer=torch.empty(b, dtype=torch.int32, device=dev))
    w.plan(inp["indptr_host"], inp["indices"], inp["last_host"], sh.num_heads, sh.num_kv_heads, sh.head_dim,
           sh.page_size, q_data_type=sh.dtype, kv_data_type=sh.dtype, sm_scale=sh.scale)
    return (lambda q, kv: w.run(q, kv)), (inp["q"], inp["kv"]), True


def fi_prefill(sh, inp, ws, backend: str):
    fi = _flashinfer()
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(inp["qo_indptr_host"], inp["indptr_host"], inp["indices"], inp["last_host"], sh.num_heads,
           sh.num_kv_heads, sh.head_dim, sh.page_size, causal=True, q_data_type=sh.dtype, kv_data_type=sh.dtype,
           sm_scale=sh.scale)
    return (lambda q, kv: w.run(q, kv)), (inp["q"], inp["kv"]), False


def trtllm_decode(sh, inp, xqa_ws, backend: str):
    _flashinfer()
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache
    bt, lens = inp["block_tables"], inp["seq_lens"]
    max_len = bt.shape[1] * sh.page_size

    def run(q, kv):
        return trtllm_batch_decode_with_kv_cache(q, kv, xqa_ws, bt, lens, max_len, bmm1_scale=sh.scale,
                                                 bmm2_scale=1.0, kv_layout="NHD", backend=backend)
    return run, (inp["q"], inp["kv"]), True


def triton_moe(sh, inp, w):
    from moeserve.ops.moe.triton_kernels import fused_moe
    return (lambda x, tw, ids, w13, w2: fused_moe(x, w13, w2, tw, ids)), \
        (inp["x"], inp["weights"], inp["ids"], w["w13"], w["w2"]), True


def torch_moe_kernel(sh, inp, w):
    from moeserve.ops.moe.torch_ref import torch_moe
    return (lambda x, tw, ids: torch_moe(x, w["w13"], w["w2"], tw, ids)), (inp["x"], inp["weights"], inp["ids"]), False


def cutlass_moe(sh, inp, w):
    _flashinfer()
    from flashinfer.fused_moe import cutlass_fused_moe
    if "w31" not in w:  # TensorRT-LLM's first GEMM wants [up; gate], moeserve stores [gate; up]
        i = sh.intermediate
        w["w31"] = torch.cat([w["w13"][:, i:], w["w13"][:, :i]], dim=1).contiguous()

    def run(x, tw, ids, w31, w2):
        out = cutlass_fused_moe(x, ids.to(torch.int32), tw.to(torch.float32), w31, w2, x.dtype, quant_scales=[])
        return out[0] if isinstance(out, (list, tuple)) else out
    return run, (inp["x"], inp["weights"], inp["ids"], w["w31"], w["w2"]), True


# --- what can run here -----------------------------------------------------------------------------

def cutlass_module_built(arch: str) -> bool:
    """Whether FlashInfer's CUTLASS fused-MoE module for ``arch`` is already compiled (or cached/AOT)."""
    _flashinfer()
    from flashinfer.jit import env as jit_env
    name = f"fused_moe_{arch}"
    try:
        from moeserve.kernels.jit_hook import cache_lookup
        if cache_lookup(name) is not None:
            return True
    except ImportError:
        pass
    return any((d / name / f"{name}.so").is_file() for d in (jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_AOT_DIR))


def skip_reason(needs: str, capability: tuple[int, int], allow_slow_jit: bool) -> str | None:
    sm = f"sm{capability[0]}{capability[1]}"
    if needs == "sm90" and capability[0] != 9:
        return f"FA3 needs sm90; this GPU is {sm}"
    if needs == "xqa" and capability[0] not in (9, 10, 12):
        return f"XQA runs on sm90, sm100 and sm120; this GPU is {sm}"
    if needs == "sm100" and capability not in ((10, 0), (10, 3)):
        return f"trtllm-gen attention kernels run on sm100/sm103 only; this GPU is {sm}"
    if needs == "cutlass":
        arch = CUTLASS_MOE_ARCHS.get(capability)
        if arch is None:
            return f"cutlass_fused_moe has no module for {sm}"
        if not allow_slow_jit and not cutlass_module_built(arch):
            return (f"FlashInfer's CUTLASS fused-MoE module (fused_moe_{arch}) is not built here and a cold build "
                    "takes over 9 minutes; build it first (moeserve precompile / a kernel cache) or pass "
                    "--allow-slow-jit")
    return None


# --- measuring -------------------------------------------------------------------------------------

def time_us(fn, args, graph: bool) -> tuple[float, str]:
    """Median kernel time in microseconds with a cold L2, and how it was measured."""
    try:
        _flashinfer()
        from flashinfer.testing import bench_gpu_time
    except ImportError:
        return own_time_us(fn, args, graph)
    times = bench_gpu_time(fn, input_args=tuple(args), use_cuda_graph=graph, cold_l2_cache=True,
                           dry_run_time_ms=25, repeat_time_ms=200, num_iters_within_graph=20)
    how = "CUDA graph, rotating input copies" if graph else "CUDA events, L2 flush per launch"
    return statistics.median(times) * 1e3, f"flashinfer.testing.bench_gpu_time ({how}, cold L2)"


def own_time_us(fn, args, graph: bool, repeats: int = 50) -> tuple[float, str]:
    """Without FlashInfer's harness: write a 256 MiB buffer before each timed launch (or graph replay)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    run = lambda: fn(*args)  # noqa: E731
    for _ in range(3):
        run()
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        flush.zero_()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e3 for s, e in events]
    return statistics.median(times), f"CUDA events{', CUDA graph' if graph else ''}, 256 MiB L2 flush per launch"


def cuda_alive(device) -> bool:
    """False once a kernel has broken the CUDA context (every later CUDA call would fail too)."""
    if torch.device(device).type != "cuda":
        return True
    try:
        torch.ones(1, device=device).add_(1)
        torch.cuda.synchronize(device)
        return True
    except Exception:
        return False


def measure(make, ref: torch.Tensor, tol: float, row: dict) -> dict:
    """Build the kernel, check it against ``ref``, time it; fills and returns ``row``."""
    fn, args, graph = make()
    t0 = time.perf_counter()
    out = fn(*args)
    if ref.is_cuda:
        torch.cuda.synchronize(ref.device)
    row["first_call_s"] = time.perf_counter() - t0
    err = (out.float() - ref).abs().max().item()
    scale = ref.abs().max().item() or 1.0
    row.update(max_error=err / scale, max_abs_error=err, tolerance=tol,
               status="ok" if err <= tol * scale else "mismatch")
    try:
        row["time_us"], row["timing"] = time_us(fn, args, graph)
    except Exception as e:
        if not graph or not cuda_alive(ref.device):
            raise
        row["time_us"], row["timing"] = time_us(fn, args, False)
        row["timing"] += f"; CUDA-graph timing failed ({type(e).__name__}: {str(e)[:120]})"
    return row


def attention_traffic(sh: Shapes, inp: dict) -> tuple[float, float]:
    """(bytes moved, floating-point operations) of one attention call."""
    el = torch.empty((), dtype=sh.dtype).element_size()
    b, n, qn = inp["batch"], inp["kv_len"], inp["q_len"]
    moved = (b * n * 2 * sh.num_kv_heads + 2 * b * qn * sh.num_heads) * sh.head_dim * el
    pairs = b * sum(n - qn + i + 1 for i in range(qn))
    return moved, 4.0 * pairs * sh.num_heads * sh.head_dim


def moe_traffic(sh: Shapes, inp: dict) -> tuple[float, float]:
    el = torch.empty((), dtype=sh.dtype).element_size()
    active = inp["ids"].unique().numel()
    t = inp["tokens"]
    moved = (active * 3 * sh.hidden * sh.intermediate + 2 * t * sh.hidden) * el
    return moved, 2.0 * t * sh.top_k * 3 * sh.hidden * sh.intermediate


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
    from moeserve.kernels import clear_jit_events, jit_events
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
    from moeserve.bench.cli import _say, base_result, output_dir, resolve_config
    from moeserve.bench.report import print_result, write_json, write_result
    t0 = time.monotonic()
    log = _say(t0)
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
        from moeserve.kernels import KernelCacheError, use_kernel_cache
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
