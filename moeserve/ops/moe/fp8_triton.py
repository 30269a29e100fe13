"""Block-FP8 fused mixture-of-experts in Triton (W8A8, like vLLM's ``fused_moe_kernel`` with
``use_fp8_w8a8`` and ``block_shape=[128, 128]``).

Weights are e4m3 with float32 128x128 block scales (``w13 [E, 2I, H]`` gate rows first with scales
``[E, ceil(2I/128), ceil(H/128)]``, ``w2 [E, H, I]`` with ``[E, ceil(H/128), ceil(I/128)]``). Activations are
quantised per token and per 128 channels just before each grouped GEMM, which multiplies e4m3 tiles on the
tensor cores and applies ``a_scale[token, k // 128] * b_scale[n // 128, k // 128]`` to each K tile's fp32
partial product. Token alignment, SiLU-and-mul and the tile-config defaults come from the bf16 kernel.

Everything here is free of host synchronisation (CUDA-graph capturable). Under ``TRITON_INTERPRET=1`` (CPU
tensors) the activation quantisation runs in torch: Triton 3.6's interpreter rounds float32 to e4m3 without
carrying into the exponent (7.86 becomes 4.0), which the GPU's conversion does not do.
"""
from __future__ import annotations

import functools
import json
import os

import torch
import triton
import triton.language as tl

from moeserve.quant.fp8 import BLOCK, EPS, FP8_DTYPE, FP8_MAX, block_scale_shape, per_token_group_quant_fp8

from .combine import SharedExpertOutput, moe_combine
from .triton_configs import CONFIG_DIR, CONFIG_DIR_ENV, config_file_name, default_config, device_name, parse_configs
from .triton_kernels import launch_params, moe_align_block_size, program_tile, silu_and_mul, store_tile, tile_rows

__all__ = ["fused_moe_fp8", "quantize_activations", "per_token_group_quant_fp8_triton", "get_fp8_config",
           "invoke_fused_moe_fp8_kernel"]

FP8_CONFIG_TAG = "fp8_w8a8"
BLOCK_SHAPE = [BLOCK, BLOCK]


@triton.jit
def _per_token_group_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, eps,
                                  FP8_MAX_V: tl.constexpr, GROUP: tl.constexpr):
    """``s[m, g] = max(|x[m, g*G:(g+1)*G]|, eps) / 448`` and ``q = clamp(x / s)`` as e4m3, one group per program."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), eps)
    s = amax / FP8_MAX_V
    q = tl.clamp(x / s, -FP8_MAX_V, FP8_MAX_V)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g, s)


def per_token_group_quant_fp8_triton(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton twin of ``moeserve.quant.fp8.per_token_group_quant_fp8``: ``(q [M, K] e4m3, s [M, ceil(K/g)])``."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        x = x if x.stride(-1) == 1 else x.contiguous()
        _per_token_group_quant_kernel[(m, groups)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0), EPS,
                                                   FP8_MAX_V=FP8_MAX, GROUP=group, num_warps=1, num_stages=1)
    return q, s


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 activation quantisation: the Triton kernel on a GPU (and on ``meta`` tensors, where ahead-of-time
    builds enumerate the launches), the torch reference on CPU (interpreter)."""
    if x.device.type != "cpu":
        return per_token_group_quant_fp8_triton(x)
    return per_token_group_quant_fp8(x)


@triton.jit(do_not_specialize=["EM", "num_valid_tokens", "top_k"])
def fused_moe_fp8_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr, sorted_token_ids_ptr,
                         expert_ids_ptr, num_tokens_post_padded_ptr, N, K, EM, num_valid_tokens, top_k,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
                         GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                         BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                         GROUP_SIZE_M: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr):
    """Grouped W8A8 GEMM ``C[s, :] = deq(A)[s // top_k, :] @ deq(B[expert(s)])^T`` over expert-sorted rows.

    ``A`` e4m3 ``[*, K]`` with per-token-group scales ``[*, ceil(K/GROUP_K)]``; ``B`` e4m3 ``[E, N, K]`` with
    block scales ``[E, ceil(N/GROUP_N), ceil(K/GROUP_K)]``; ``BLOCK_SIZE_K`` divides ``GROUP_K`` so each K tile
    has one activation scale per row and one weight scale per column. Rows, padding, routed-weight scaling
    and the early exit past ``num_tokens_post_padded`` work as in the bf16 ``fused_moe_kernel``.
    """
    pid_m, pid_n = program_tile(EM, N, BLOCK_SIZE_M, BLOCK_SIZE_N, GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_token, token_mask, off_expert = tile_rows(sorted_token_ids_ptr, expert_ids_ptr, pid_m, num_valid_tokens,
                                                   BLOCK_SIZE_M)

    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_rows = offs_token // top_k
    a_ptrs = a_ptr + (a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = b_ptr + off_expert * stride_be + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)
    a_scale_ptrs = a_scale_ptr + a_rows * stride_asm
    b_scale_ptrs = b_scale_ptr + off_expert * stride_bse + (offs_bn // GROUP_N) * stride_bsn

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=token_mask[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_SIZE_K
            a = tl.load(a_ptrs, mask=token_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        ks = (k * BLOCK_SIZE_K) // GROUP_K
        a_s = tl.load(a_scale_ptrs + ks * stride_ask, mask=token_mask, other=0.0)
        b_s = tl.load(b_scale_ptrs + ks * stride_bsk)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    store_tile(acc, c_ptr, topk_weights_ptr, offs_token, token_mask, pid_n, N, stride_cm, stride_cn, BLOCK_SIZE_N,
               MUL_ROUTED_WEIGHT)


def invoke_fused_moe_fp8_kernel(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                                c: torch.Tensor, topk_weights: torch.Tensor | None, sorted_token_ids: torch.Tensor,
                                expert_ids: torch.Tensor, num_tokens_post_padded: torch.Tensor, top_k: int,
                                config: dict, max_padded_rows: int | None = None):
    """Launch :func:`fused_moe_fp8_kernel` for ``c = deq(a)[rows // top_k] @ deq(b[e])^T`` (see
    ``triton_kernels.invoke_fused_moe_kernel`` for the row conventions)."""
    num_valid, n = c.shape
    k = b.shape[2]
    meta, opts, em, grid = launch_params(config, n, sorted_token_ids, max_padded_rows)
    mul_w = topk_weights is not None
    fused_moe_fp8_kernel[grid](
        a, b, c, a_scale, b_scale, topk_weights if mul_w else c, sorted_token_ids, expert_ids,
        num_tokens_post_padded, n, k, em, num_valid, top_k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        GROUP_N=BLOCK, GROUP_K=BLOCK, MUL_ROUTED_WEIGHT=mul_w, EVEN_K=k % meta["BLOCK_SIZE_K"] == 0,
        **meta, **opts)


# --- tile configs ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def load_fp8_configs(E: int, N: int, H: int, device: str) -> dict[int, dict] | None:
    """The tuned ``{M: config}`` table for FP8 block-scaled experts of this shape, or ``None``.

    File name: ``E=..,N=..,H=..,device_name=..,dtype=fp8_w8a8,block_shape=[128,128].json``, searched in
    ``$MOESERVE_MOE_CONFIG_DIR`` and then next to the bf16 configs.
    """
    name = config_file_name(E, N, H, FP8_CONFIG_TAG, device, BLOCK_SHAPE)
    dirs = ([os.environ[CONFIG_DIR_ENV]] if os.environ.get(CONFIG_DIR_ENV) else []) + [str(CONFIG_DIR)]
    for d in dirs:
        path = os.path.join(d, name)
        if os.path.isfile(path):
            with open(path) as f:
                return parse_configs(json.load(f))
    return None


def _fit_block_k(cfg: dict) -> dict:
    """``BLOCK_SIZE_K`` must divide the 128-wide scale group: keep it at 128 or a power of two below it."""
    bk = int(cfg["BLOCK_SIZE_K"])
    if bk > BLOCK or BLOCK % bk:
        cfg["BLOCK_SIZE_K"] = BLOCK
    return cfg


def get_fp8_config(M: int, E: int, N: int, H: int, top_k: int) -> tuple[dict, bool]:
    """``(config, tuned)`` for ``M`` tokens: the nearest tuned bucket of an FP8 table, else the bf16 default
    heuristic with ``BLOCK_SIZE_K = 128`` (one scale group per K tile; 128 fp8 bytes like 64 bf16 ones)."""
    table = load_fp8_configs(int(E), int(N), int(H), device_name())
    if table:
        nearest = min(table, key=lambda m: (abs(m - M), m))
        return _fit_block_k(dict(table[nearest])), True
    return default_fp8_config(M, E, N, H, top_k), False


def default_fp8_config(M: int, E: int, N: int, H: int, top_k: int) -> dict:
    """The untuned FP8 config: the bf16 default heuristic with ``BLOCK_SIZE_K = 128``."""
    cfg = default_config(M, E, N, H, top_k, torch.bfloat16)
    cfg["BLOCK_SIZE_K"] = BLOCK
    return cfg


# --- the layer ------------------------------------------------------------------------------------

def _check_inputs(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids):
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"fused_moe_fp8 supports bf16/fp16/fp32 activations, got {x.dtype}")
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise TypeError(f"fused_moe_fp8 needs float8_e4m3fn weights; got {w13.dtype}, {w2.dtype}")
    t, h = x.shape
    e, two_i, h13 = w13.shape
    if h13 != h or w2.shape != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    for name, s, (n, k) in (("w13_scale", w13_scale, (two_i, h)), ("w2_scale", w2_scale, (h, two_i // 2))):
        want = (e, *block_scale_shape(n, k))
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"{name}: expected float32 block scales of shape {list(want)}, got "
                             f"{s.dtype} {list(s.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"routing shape mismatch: ids {tuple(topk_ids.shape)}, weights {tuple(topk_weights.shape)}")


def fused_moe_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  config: dict | None = None, out: torch.Tensor | None = None,
                  shared: SharedExpertOutput | None = None, masked_ids: bool = False) -> torch.Tensor:
    """Block-FP8 SwiGLU experts: ``sum_j w[t,j] * W2[e] Q(silu(G_e Q(x_t)) * U_e Q(x_t))``, ``e = ids[t,j]``.

    Shapes as in ``triton_kernels.fused_moe`` plus the block scales; returns ``[T, H]`` in ``x.dtype``. The
    first GEMM's output and the SwiGLU output are stored in ``x.dtype`` (as ``moeserve.quant.moe_ref``
    models). ``config`` holds the tile parameters (``BLOCK_SIZE_K`` must divide 128); ``None`` picks one
    with :func:`get_fp8_config`.
    """
    _check_inputs(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
    t, h = x.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0:
        if shared is not None:
            shared.join()
        return out
    if config is None:
        config, _ = get_fp8_config(t, e, inter, h, top_k)
    if BLOCK % int(config["BLOCK_SIZE_K"]):
        raise ValueError(f"config BLOCK_SIZE_K {config['BLOCK_SIZE_K']} must divide {BLOCK}")
    rows = t * top_k
    block_m = int(config["BLOCK_SIZE_M"])
    max_rows = rows + min(rows, e) * (block_m - 1)
    sorted_ids, expert_ids, ntpp = moe_align_block_size(topk_ids, block_m, e)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()

    xq, xs = quantize_activations(x)
    gate_up = torch.empty((rows, two_i), dtype=x.dtype, device=x.device)
    invoke_fused_moe_fp8_kernel(xq, xs, w13, w13_scale, gate_up, None, sorted_ids, expert_ids, ntpp, top_k,
                                config, max_rows)
    aq, as_ = quantize_activations(silu_and_mul(gate_up, tokens=t))
    down = (torch.zeros if masked_ids else torch.empty)((rows, h), dtype=x.dtype, device=x.device)
    invoke_fused_moe_fp8_kernel(aq, as_, w2, w2_scale, down, weights, sorted_ids, expert_ids, ntpp, 1, config,
                                max_rows)
    return moe_combine(down, top_k, shared, out)
