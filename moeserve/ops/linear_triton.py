"""Dense linears for small steps: a Triton GEMV, the ``triton`` linear backend (what ``auto`` takes on a GPU for
unquantised bf16/fp16 weights; ``backends.linear: torch`` keeps cuBLAS for every step).

At decode batch sizes cuBLAS picks tile shapes made for larger M: on an H200 the c=1 step of Qwen1.5-MoE spends
1.44 ms in GEMMs whose weights need ~0.77 ms to read. Here each program owns ``BLOCK_N`` output features and
walks the whole ``K`` of their weight rows, multiplying by every row of ``x`` at once (``tl.dot`` with the rows
padded to 16); the bias is added in the epilogue. One-row steps of weights of at most 4,096 rows (the output
projection) run a kernel without ``tl.dot`` (:func:`_gemv_row_kernel`, :func:`gemv_row_config`): a few rows a
program, their tiles multiplied elementwise in registers, 1.2% faster at c=1. Steps of more than ``max_tokens``
rows, weights narrower than ``GEMV_MIN_N`` (a router) or wider than ``GEMV_MAX_N`` and other dtypes run
``F.linear``. The LM head of one-token steps runs the GEMV too (``MoECausalLM.compute_logits`` goes through the
linear backend): it launches under PDL, 1.6 us after the last norm starts where cuBLAS started 6.6 us after it,
and c=1 decoded 0.6% to 0.7% faster than with it on cuBLAS (docs/results/2026-12-04-h200-z2).

Measured on an H200 (docs/results/2026-12-01-h200-b), with a first tile config (BLOCK_N 16): a c=1 decode
step's GEMM time went from 1.44 ms (cuBLAS) to 1.57 ms (1.30 ms of it the GEMV, 96 launches), and decode
throughput at c = 1 to 8 moved by less than the run-to-run spread. With the current tiles and the LM head left
to cuBLAS (docs/results/2026-12-02-h200-m), ``linear_gemv_max_tokens: 1`` (the default) decoded 1.9% faster
than cuBLAS at c=1 in one A/B of two rounds; at c=2 the GEMV (``linear_gemv_max_tokens: 4``) was 2.5% slower.
So by default only one-token steps run it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.ops.eager import eager
from moeserve.ops.interfaces import LinearBackend
from moeserve.ops.pdl import launch_kwargs
from moeserve.ops.pdl_triton import wait_prior
from moeserve.quant.fp8 import fp8_linear_reference

GEMV_MAX_ROWS = 16  # rows of x one launch takes (tl.dot's smallest tile)
GEMV_MIN_N = 256  # narrower weights (a router) leave most SMs idle in a GEMV: cuBLAS
GEMV_MAX_N = 1 << 18  # wider ones stay on cuBLAS; 16384 keeps the LM head (151,936 rows for Qwen) there
ROW_PRELOAD = True  # the one-row tiles load their first weight tile before the PDL wait (gemv_row_config)
# the LM head's GEMV finds the greedy tokens in its epilogue (linear_argmax; False: torch's argmax after the graph,
# an A/B switch)
FUSED_ARGMAX = True
# A/B switch: gemv_config's tiles (the QKV projection's) load their first weight tile before the PDL wait
GEMV_PRELOAD = False


@triton.jit
def _w_tile(w_ptrs, offs_k, k_left, EVEN_K: tl.constexpr):
    """A weight tile ``[*, BLOCK_K]``, its columns past ``k_left`` (the K left from this tile on) zero."""
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=(offs_k < k_left)[None, :], other=0.0)
    return w


@triton.jit
def _xt_tile(x_ptrs, offs_k, m_mask, k_left, EVEN_K: tl.constexpr):
    """A tile of ``x^T`` ``[BLOCK_K, M_PAD]``: the rows ``m_mask`` of x, its columns past ``k_left`` zero."""
    if EVEN_K:
        xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
    else:
        xt = tl.load(x_ptrs, mask=m_mask[None, :] & (offs_k < k_left)[:, None], other=0.0)
    return xt


@triton.jit
def _x_row(x_ptrs, offs_k, k_left, EVEN_K: tl.constexpr):
    """A tile ``[BLOCK_K]`` of one row of x, its columns past ``k_left`` zero."""
    if EVEN_K:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=offs_k < k_left, other=0.0)
    return x


@triton.jit
def _argmax_key(v, offs_n):
    """The key of each column's largest ``v`` ``[BLOCK_N, M_PAD]`` (rows past the weight at -inf), its first row on
    ties: the value made an int32 that orders as the float does (-0.0 counted as 0.0) in the high half, ``2**31 - 1``
    less the row in the low half, so that the largest int64 key is the largest value at its lowest row."""
    mx = tl.max(v, axis=0)
    row = tl.min(tl.where(v == mx[None, :], offs_n[:, None], 2147483647), axis=0)
    bits = tl.where(mx == 0.0, 0.0, mx).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - row).to(tl.int64)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr,
                 EVEN_K: tl.constexpr, PDL: tl.constexpr = False, PRELOAD: tl.constexpr = False,
                 best_ptr=None, ARGMAX: tl.constexpr = False):
    """``y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n])`` for ``m < M <= M_PAD``, float32 accumulation. ``PRELOAD``:
    the first weight tile is loaded before the PDL wait (nothing in a step writes the weights), ``x`` after it.
    ``ARGMAX``: each program also folds its features' largest ``y[m]`` (as stored) into ``best[m]`` with one
    atomic max of :func:`_argmax_key` (``best`` int64 ``[M]``, reset by :func:`_greedy_tokens_kernel`)."""
    if not PRELOAD:
        wait_prior(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = (offs_n % N).to(tl.int64)  # past-the-end features re-read a valid row; their outputs are masked
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # x^T tile [BLOCK_K, M_PAD]
    acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    k_first = 0
    if PRELOAD:  # the first K tile: its weights before the wait, x after it; the loop takes the rest
        w = _w_tile(w_ptrs, offs_k, K, EVEN_K)
        wait_prior(PDL)
        acc = tl.dot(w, _xt_tile(x_ptrs, offs_k, m_mask, K, EVEN_K), acc=acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_first = 1
    for k in range(k_first, tl.cdiv(K, BLOCK_K)):
        w = _w_tile(w_ptrs, offs_k, K - k * BLOCK_K, EVEN_K)
        xt = _xt_tile(x_ptrs, offs_k, m_mask, K - k * BLOCK_K, EVEN_K)
        acc = tl.dot(w, xt, acc=acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptrs, y, mask=(offs_n[:, None] < N) & m_mask[None, :])
    if ARGMAX:
        v = tl.where((offs_n < N)[:, None], y.to(tl.float32), float("-inf"))
        tl.atomic_max(best_ptr + offs_m, _argmax_key(v, offs_n), mask=m_mask, sem="relaxed")


BEST_EMPTY = -(1 << 63)  # an argmax slot no program has written (below every key)
_EMPTY = tl.constexpr(BEST_EMPTY)


@triton.jit
def _greedy_tokens_kernel(best_ptr, tokens_ptr, M, BLOCK_M: tl.constexpr, PDL: tl.constexpr = False):
    """``tokens[m]`` = the row of the largest logit :func:`_gemv_kernel` (``ARGMAX``) found for row ``m``; empties
    ``best`` for the next launch."""
    wait_prior(PDL)
    offs = tl.arange(0, BLOCK_M)
    mask = offs < M
    key = tl.load(best_ptr + offs, mask=mask, other=0)
    tl.store(tokens_ptr + offs, 0x7FFFFFFF - (key & 0x7FFFFFFF), mask=mask)
    tl.store(best_ptr + offs, tl.full((BLOCK_M,), _EMPTY, tl.int64), mask=mask)


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     PDL: tl.constexpr = False, PRELOAD: tl.constexpr = False):
    """``y[n] = sum_k x[k] * w[n, k] (+ b[n])`` for one row of ``x``: the weight tile goes from global memory
    straight to registers and is multiplied elementwise, float32 partial sums per column reduced once at the
    end (no shared memory and no 16-row padding, as :func:`_gemv_kernel`'s ``tl.dot`` needs). ``PRELOAD``: the
    first weight tile is loaded before the PDL wait (with the built-in tiles of the output projection, the whole
    K), ``x`` after it."""
    if not PRELOAD:
        wait_prior(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = (offs_n % N).to(tl.int64)  # past-the-end features re-read a valid row; their outputs are masked
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_first = 0
    if PRELOAD:  # the first K tile: its weights before the wait, x after it; the loop takes the rest
        w = _w_tile(w_ptrs, offs_k, K, EVEN_K)
        wait_prior(PDL)
        acc += w.to(tl.float32) * _x_row(x_ptr + offs_k, offs_k, K, EVEN_K).to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        k_first = 1
    for k in range(k_first, tl.cdiv(K, BLOCK_K)):
        w = _w_tile(w_ptrs, offs_k, K - k * BLOCK_K, EVEN_K)
        x = _x_row(x_ptr + k * BLOCK_K + offs_k, offs_k, K - k * BLOCK_K, EVEN_K)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows_n).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def gemv_config(n: int, k: int) -> dict:
    """Tile parameters for an ``[n, k]`` weight, from ``python -m moeserve.bench.gemv --sweep`` on an H200 (the
    linears back to back in a CUDA graph with PDL, docs/results/2026-12-02-h200-q) for the Qwen1.5-MoE linears:
    BLOCK_N 32 for K = 2048, 16 with long rows; a weight of at most 4,096 rows (fewer programs than SMs: the
    2048 x 2048 output projection) takes twice the K tile, more bytes in flight per program (5.55 against
    6.27 us)."""
    if k >= 4096:
        return {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 4}
    if n <= 4096:
        return {"BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3}
    tiles = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}
    return {**tiles, "preload": True} if GEMV_PRELOAD and n <= 16384 else tiles


def gemv_row_config(n: int, k: int) -> dict | None:
    """Tiles of :func:`_gemv_row_kernel` for a one-row step of an ``[n, k]`` weight, or None where
    :func:`_gemv_kernel` serves one row better. From a sweep on an H200 (the linears back to back in a CUDA graph
    with PDL; ``python -m moeserve.bench.gemv --sweep`` runs the same one-row tiles) and A/Bs of the decode step
    (docs/results/2026-12-04-h200-y): the 2048 x 2048 output projection reads in 3.85 us with four rows a program
    and the whole K in one tile, against 5.74 us through :func:`_gemv_kernel`; in a step it ended 1.7 us sooner
    and c=1 decoded 1.2% and 1.6% faster. The 6144 x 2048 QKV projection was faster alone too (8.3 against 10.0 us)
    but not in a step: the decode attention after it, which loads its first keys before it waits for the
    projection, is launched under PDL only once every program of the projection has started, 7 us into the
    one-row kernel's 768 programs against 1.3 us into :func:`_gemv_kernel`'s 192; it ended 3.3 to 3.5 us later
    (+0.9% with both projections against +1.2% with the output projection's alone). So weights of more than
    4,096 rows keep :func:`_gemv_kernel`. Other weights of at most 4,096 rows take the same tiles, untimed (the
    shared expert's down projection, K = 5632, which one-token steps run inside the fused MoE by default).

    With :data:`ROW_PRELOAD` (the default) the tiles carry ``"preload"``: each program loads its weight tile (with
    K = 2048, its whole share of the weight) before it waits for the decode attention under PDL, so the weights
    stream while the attention runs; c=1 decoded 1.9% faster in three rounds of an A/B, c=8 the same
    (docs/results/2026-12-04-h200-z2). The same preload in the QKV projection's :func:`_gemv_kernel`, after the
    Triton add + RMSNorm, was 0.3% slower (and 1.4% faster with both, against 1.9% with the output's alone), so
    :func:`gemv_config`'s tiles do not take it."""
    if n <= 4096:
        tiles = {"row": True, "BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 3}
        return {**tiles, "preload": True} if ROW_PRELOAD else tiles
    return None


def gemv_tiles(m: int, n: int, k: int) -> dict:
    """The tiles :func:`gemv` takes for ``m`` rows times an ``[n, k]`` weight: :func:`gemv_row_config`'s for one
    row where it has them (``"row": True``: :func:`_gemv_row_kernel`), else :func:`gemv_config`'s."""
    return (gemv_row_config(n, k) if m == 1 else None) or gemv_config(n, k)


def _preload(tiles: dict) -> dict:
    """The kernel argument of tiles with ``"preload": True`` (none otherwise, so that the default kernels compile
    as before)."""
    return {"PRELOAD": True} if tiles.get("preload") else {}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: dict | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` for ``x`` ``[..., K]`` of at most :data:`GEMV_MAX_ROWS` rows, ``weight``
    ``[N, K]`` contiguous, both bf16 or fp16; returns ``[..., N]`` in ``x.dtype``."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes at most {GEMV_MAX_ROWS} rows, got {m}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    c = config or gemv_tiles(m, n, k)
    if c.get("row"):
        if m != 1:
            raise ValueError(f"the one-row GEMV's tiles were given {m} rows")
        _gemv_row_kernel[(triton.cdiv(n, c["BLOCK_N"]),)](
            x2, weight, bias if bias is not None else weight, y, n, k, weight.stride(0), HAS_BIAS=bias is not None,
            BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], EVEN_K=k % c["BLOCK_K"] == 0, num_warps=c["num_warps"],
            num_stages=c["num_stages"], **_preload(c), **launch_kwargs(m))
        return y.reshape(*lead, n)
    grid = (triton.cdiv(n, c["BLOCK_N"]),)
    _gemv_kernel[grid](x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0), weight.stride(0),
                       y.stride(0), HAS_BIAS=bias is not None, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                       M_PAD=GEMV_MAX_ROWS, EVEN_K=k % c["BLOCK_K"] == 0, num_warps=c["num_warps"],
                       num_stages=c["num_stages"], **_preload(c), **launch_kwargs(m))
    return y.reshape(*lead, n)


def gemv_argmax(x: torch.Tensor, weight: torch.Tensor, best: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, tokens)``: ``y = x @ weight^T`` as :func:`gemv` computes it (:func:`_gemv_kernel` with
    :func:`gemv_config`'s tiles) and ``tokens = y.argmax(-1)`` (int64, the first of equal values, as torch's), found
    in the GEMV's epilogue and read by one more launch. ``best``: int64, at least as many entries as ``x`` has rows,
    every one :data:`BEST_EMPTY` (as this leaves them)."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if not 0 < m <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv_argmax takes 1 to {GEMV_MAX_ROWS} rows, got {m}")
    if best.dtype != torch.int64 or best.numel() < m:
        raise ValueError(f"gemv_argmax: best must be int64 with at least {m} entries")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tokens = torch.empty(m, dtype=torch.int64, device=x.device)
    c = gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, c["BLOCK_N"]),)](
        x2, weight, weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=False,
        BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], M_PAD=GEMV_MAX_ROWS, EVEN_K=k % c["BLOCK_K"] == 0,
        num_warps=c["num_warps"], num_stages=c["num_stages"], best_ptr=best, ARGMAX=True, **launch_kwargs(m))
    _greedy_tokens_kernel[(1,)](best, tokens, m, BLOCK_M=GEMV_MAX_ROWS, num_warps=1, **launch_kwargs(m))
    return y.reshape(*lead, n), tokens.reshape(lead)


class TritonLinear(LinearBackend):
    """Steps of at most ``max_tokens`` rows (bf16/fp16 weights): :func:`gemv`; larger steps: ``F.linear``."""

    name = "triton"

    def __init__(self, device: torch.device, dtype: torch.dtype, max_tokens: int = 1):  # linear_gemv_max_tokens
        super().__init__(device, dtype)
        self.max_tokens = min(max_tokens, GEMV_MAX_ROWS)
        # gemv_argmax's slots, each empty between launches
        self.argmax_slots = torch.full((GEMV_MAX_ROWS,), BEST_EMPTY, dtype=torch.int64, device=device)

    def takes_shape(self, rows: int, n: int, dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
        """Whether a step of ``rows`` rows times an ``[n, *]`` weight runs the GEMV (also what ``moeserve
        precompile`` builds)."""
        return (0 < rows <= self.max_tokens and GEMV_MIN_N <= n <= GEMV_MAX_N
                and dtype in (torch.bfloat16, torch.float16) and weight_dtype == dtype)

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return x.is_cuda and self.takes_shape(rows, weight.shape[0], x.dtype, weight.dtype) and weight.is_contiguous()

    @eager  # a custom kernel launch: torch.compile (torch_compile: true) runs it eagerly
    def _gemv(self, x, weight, bias):
        return gemv(x, weight, bias)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.takes(x, weight):
            return self._gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    @eager
    def _gemv_argmax(self, x, weight):
        return gemv_argmax(x, weight, self.argmax_slots)

    def linear_argmax(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Steps the GEMV takes (``takes``) whose weight has more than 4,096 rows (an LM head) find the argmax in
        its epilogue (:func:`gemv_argmax`, with :data:`FUSED_ARGMAX`); the others leave it (None)."""
        if FUSED_ARGMAX and self.takes(x, weight) and gemv_row_config(*weight.shape) is None:
            return self._gemv_argmax(x, weight)
        return super().linear_argmax(x, weight)

    def linear_fp8(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear_reference(x, weight, weight_scale, bias)
