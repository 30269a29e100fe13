"""The kernels ``moeserve bench kernels`` checks and times: their inputs on the model's shapes, the torch
references, the FlashInfer / Triton / CUTLASS calls, the traffic each moves, and the timing helpers."""
from __future__ import annotations

import statistics
import time
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
    from moeserve.kernel_cache import flashinfer_env  # noqa: F401  (before flashinfer: env and JIT hook)
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
        from moeserve.kernel_cache.jit_hook import cache_lookup
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
