"""Dense linears for small steps: a Triton GEMV, the ``triton`` linear backend (what ``auto`` takes on a GPU for
unquantised bf16/fp16 weights; ``backends.linear: torch`` keeps cuBLAS for every step).

At decode batch sizes cuBLAS picks tile shapes made for larger M: on an H200 the c=1 step of Qwen1.5-MoE spends
1.44 ms in GEMMs whose weights need ~0.77 ms to read. Here each program owns ``BLOCK_N`` output features and
walks the whole ``K`` of their weight rows, multiplying by every row of ``x`` at once (``tl.dot`` with the rows
padded to 16); the bias is added in the epilogue. Steps of more than ``max_tokens`` rows, weights narrower
than ``GEMV_MIN_N`` (a router) or wider than ``GEMV_MAX_N`` (an LM head, which cuBLAS reads at the copy
bandwidth) and other dtypes run ``F.linear``.

Measured on an H200 (docs/results/2026-12-01-h200-b), with a first tile config (BLOCK_N 16): a c=1 decode
step's GEMM time went from 1.44 ms (cuBLAS) to 1.57 ms (1.30 ms of it the GEMV, 96 launches), and decode
throughput at c = 1 to 8 moved by less than the run-to-run spread. With the current tiles and the LM head left
to cuBLAS (docs/results/2026-12-02-h200-m), ``linear_gemv_max_tokens: 1`` (the default) decoded 1.9% faster
than cuBLAS at c=1 in one A/B of two rounds; at c=2 the GEMV (``linear_gemv_max_tokens: 4``) was 2.5% slower.
So by default only one-token steps run it.

A SwiGLU MLP's gate/up projection (``[2I, K]``, the gate rows first) can run as :func:`gemv_swiglu`: each program
owns ``BLOCK_N`` gate rows and the matching up rows and writes ``silu(gate) * up`` (each rounded to the output
dtype first, as the GEMV followed by the activation kernel computes it), one launch and the ``[M, 2I]``
intermediate fewer per MLP (``linear_gemv_swiglu``).
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
GEMV_MAX_N = 16384  # wider ones (the LM head) cuBLAS reads at the copy bandwidth (160 us against the GEMV's 197)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr,
                 EVEN_K: tl.constexpr, PDL: tl.constexpr = False):
    """``y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n])`` for ``m < M <= M_PAD``, float32 accumulation."""
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
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            w = tl.load(w_ptrs)
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(w, xt, acc=acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_n[:, None] < N) & m_mask[None, :])


@triton.jit
def _gemv_swiglu_kernel(x_ptr, w_ptr, y_ptr, M, I, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, EVEN_K: tl.constexpr,
                        PDL: tl.constexpr = False):
    """``y[m, i] = silu(g) * u`` with ``g = x[m] . w[i]`` and ``u = x[m] . w[I + i]``, each a float32 sum
    rounded to ``y``'s dtype, for ``m < M <= M_PAD`` and ``i < I``."""
    wait_prior(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = (offs_n % I).to(tl.int64)  # past-the-end features re-read a valid row; their outputs are masked
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    g_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + I * stride_wn
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # x^T tile [BLOCK_K, M_PAD]
    acc_g = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
            xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            wg = tl.load(g_ptrs, mask=k_mask[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=k_mask[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        acc_g = tl.dot(wg, xt, acc=acc_g)
        acc_u = tl.dot(wu, xt, acc=acc_u)
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    g = acc_g.to(y_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(y_ptr.dtype.element_ty).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(offs_n[:, None] < I) & m_mask[None, :])


def gemv_config(n: int, k: int) -> dict:
    """Tile parameters for an ``[n, k]`` weight: the fastest of ``python -m moeserve.bench.gemv --sweep`` on an
    H200 for the Qwen1.5-MoE linears (BLOCK_N 32 for K = 2048, 16 with long rows)."""
    if k >= 4096:
        return {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}


def gemv_swiglu_config(i: int, k: int) -> dict:
    """Tile parameters of :func:`gemv_swiglu` for ``I`` features of ``K`` columns: the weight bytes a program
    loads per step of ``K`` as :func:`gemv_config`'s for the ``[2I, K]`` weight (half the features, from two
    row blocks), not tuned on their own."""
    if k >= 4096:
        return {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes at most {GEMV_MAX_ROWS} rows, got {x2.shape[0]}")
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), k


def gemv_swiglu(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """``silu(x @ weight[:I]^T) * (x @ weight[I:]^T)`` for ``x`` ``[..., K]`` of at most :data:`GEMV_MAX_ROWS`
    rows and a merged gate/up ``weight`` ``[2I, K]`` (contiguous, both bf16 or fp16); returns ``[..., I]``."""
    lead, (x2, k) = x.shape[:-1], _rows(x)
    if weight.shape[0] % 2:
        raise ValueError(f"gemv_swiglu: the gate/up weight has an odd number of rows ({weight.shape[0]})")
    i, m = weight.shape[0] // 2, x2.shape[0]
    y = torch.empty((m, i), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, i)
    c = config or gemv_swiglu_config(i, k)
    _gemv_swiglu_kernel[(triton.cdiv(i, c["BLOCK_N"]),)](
        x2, weight, y, m, i, k, x2.stride(0), weight.stride(0), y.stride(0), BLOCK_N=c["BLOCK_N"],
        BLOCK_K=c["BLOCK_K"], M_PAD=GEMV_MAX_ROWS, EVEN_K=k % c["BLOCK_K"] == 0, num_warps=c["num_warps"],
        num_stages=c["num_stages"], **launch_kwargs(m))
    return y.reshape(*lead, i)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: dict | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` for ``x`` ``[..., K]`` of at most :data:`GEMV_MAX_ROWS` rows, ``weight``
    ``[N, K]`` contiguous, both bf16 or fp16; returns ``[..., N]`` in ``x.dtype``."""
    lead, (x2, k) = x.shape[:-1], _rows(x)
    n, m = weight.shape[0], x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    c = config or gemv_config(n, k)
    grid = (triton.cdiv(n, c["BLOCK_N"]),)
    _gemv_kernel[grid](x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0), weight.stride(0),
                       y.stride(0), HAS_BIAS=bias is not None, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                       M_PAD=GEMV_MAX_ROWS, EVEN_K=k % c["BLOCK_K"] == 0, num_warps=c["num_warps"],
                       num_stages=c["num_stages"], **launch_kwargs(m))
    return y.reshape(*lead, n)


class TritonLinear(LinearBackend):
    """Steps of at most ``max_tokens`` rows (bf16/fp16 weights): :func:`gemv`, and with ``swiglu`` a SwiGLU
    MLP's gate/up projection and activation as :func:`gemv_swiglu`; larger steps: ``F.linear``."""

    name = "triton"

    def __init__(self, device: torch.device, dtype: torch.dtype, max_tokens: int = 1,  # linear_gemv_max_tokens
                 swiglu: bool = False):  # linear_gemv_swiglu
        super().__init__(device, dtype)
        self.max_tokens = min(max_tokens, GEMV_MAX_ROWS)
        self.swiglu = swiglu

    def takes_shape(self, rows: int, n: int, dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
        """Whether a step of ``rows`` rows times an ``[n, *]`` weight runs the GEMV (also what ``moeserve
        precompile`` builds)."""
        return (0 < rows <= self.max_tokens and GEMV_MIN_N <= n <= GEMV_MAX_N
                and dtype in (torch.bfloat16, torch.float16) and weight_dtype == dtype)

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return x.is_cuda and self.takes_shape(rows, weight.shape[0], x.dtype, weight.dtype) and weight.is_contiguous()

    def takes_swiglu_shape(self, rows: int, n: int, dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
        """Whether a SwiGLU MLP's ``[n, *]`` gate/up projection of a ``rows``-row step runs :func:`gemv_swiglu`."""
        return self.swiglu and n % 2 == 0 and self.takes_shape(rows, n, dtype, weight_dtype)

    @eager  # a custom kernel launch: torch.compile (torch_compile: true) runs it eagerly
    def _gemv(self, x, weight, bias):
        return gemv(x, weight, bias)

    @eager
    def _gemv_swiglu(self, x, weight):
        return gemv_swiglu(x, weight)

    def linear_swiglu(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (x.is_cuda and weight.is_contiguous()
                and self.takes_swiglu_shape(rows, weight.shape[0], x.dtype, weight.dtype)):
            return self._gemv_swiglu(x, weight)
        return None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.takes(x, weight):
            return self._gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    def linear_fp8(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear_reference(x, weight, weight_scale, bias)
