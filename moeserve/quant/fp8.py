"""FP8 (e4m3) quantisation in the DeepSeek-V3 / Qwen3-FP8 layout, in plain torch (any device).

Weights: ``float8_e4m3fn`` ``[N, K]`` plus ``weight_scale_inv`` float32 ``[ceil(N/128), ceil(K/128)]``; the
real value of element ``(n, k)`` is ``q[n, k] * scale[n // 128, k // 128]``. Each 128x128 block (the last
row/column of blocks may be partial) is scaled so its largest magnitude maps to 448, the e4m3 maximum.

Activations: quantised on the fly per token and per group of 128 consecutive channels ("1x128"), with one
float32 scale per (token, group): ``q [M, K]``, ``scale [M, ceil(K/128)]``, as vLLM's
``per_token_group_quant_fp8`` and FlashInfer's internal 1x128 quantiser do.

These functions are the reference every fast path is checked against.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
EPS = 1e-10


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_scale_shape(n: int, k: int, block: int = BLOCK) -> tuple[int, int]:
    """Shape of the ``weight_scale_inv`` of an ``[n, k]`` weight: ``(ceil(n/block), ceil(k/block))``."""
    return cdiv(n, block), cdiv(k, block)


def _pad_to_blocks(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    pr, pc = rows - x.shape[-2], cols - x.shape[-1]
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x


@torch.no_grad()
def block_quant_fp8(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w [..., N, K]`` into ``(q float8_e4m3fn [..., N, K], scale float32 [..., ceil(N/b), ceil(K/b)])``.

    The scale of a block is ``max|w| / 448`` over the block (at least ``1e-10 / 448``), so ``q * scale``
    recovers ``w`` to e4m3 precision (relative error at most 2^-4 per element, before the clamp).
    """
    *lead, n, k = w.shape
    nb, kb = block_scale_shape(n, k, block)
    x = _pad_to_blocks(w.float(), nb * block, kb * block)
    x = x.reshape(*lead, nb, block, kb, block)
    amax = x.abs().amax(dim=(-3, -1)).clamp_min(EPS)  # [..., nb, kb]
    scale = amax / FP8_MAX
    q = (x / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, nb * block, kb * block)[..., :n, :k].contiguous()
    return q, scale.contiguous()


def expand_block_scale(scale: torch.Tensor, n: int, k: int, block: int = BLOCK) -> torch.Tensor:
    """Per-element scales ``[..., n, k]`` from block scales ``[..., ceil(n/b), ceil(k/b)]``."""
    s = scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return s[..., :n, :k]


def block_dequant_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                      block: int = BLOCK) -> torch.Tensor:
    """``q * scale`` per 128x128 block, computed in float32 and returned in ``dtype``."""
    n, k = q.shape[-2:]
    if tuple(scale.shape[-2:]) != block_scale_shape(n, k, block):
        raise ValueError(f"block scale shape {list(scale.shape)} does not fit a weight of shape {list(q.shape)} "
                         f"(expected [..., {cdiv(n, block)}, {cdiv(k, block)}])")
    return (q.float() * expand_block_scale(scale.float(), n, k, block)).to(dtype)


@torch.no_grad()
def per_token_group_quant_fp8(x: torch.Tensor, group: int = BLOCK, eps: float = EPS
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations ``x [M, K]`` per token and per group of ``group`` channels.

    Returns ``(q float8_e4m3fn [M, K], scale float32 [M, ceil(K/group)])`` with ``scale = max(|x_g|, eps)/448``
    and ``q = clamp(x / scale, -448, 448)``; the last group may be partial.
    """
    m, k = x.shape
    g = cdiv(k, group)
    xf = x.float()
    if g * group != k:
        xf = torch.nn.functional.pad(xf, (0, g * group - k))
    xf = xf.view(m, g, group)
    scale = xf.abs().amax(dim=-1).clamp_min(eps) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, g * group)[:, :k].contiguous(), scale.contiguous()


def per_token_group_dequant(q: torch.Tensor, scale: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """float32 ``q * scale`` for per-token-group quantised activations."""
    k = q.shape[-1]
    return q.float() * scale.float().repeat_interleave(group, dim=-1)[..., :k]


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 block-FP8 linear layer as the GPU kernels compute it, in float32: ``y = Q(x) @ deq(W)^T + b``.

    ``x [..., K]`` (any float dtype) is quantised 1x128 per token, ``weight`` is e4m3 ``[N, K]`` with 128x128
    block scales; both are dequantised exactly to float32 and multiplied in float32, so this differs from
    ``fp8_blockscale_gemm_sm90`` only by accumulation order. Returns ``[..., N]`` in ``x.dtype``.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    xq, xs = per_token_group_quant_fp8(x2)
    y = per_token_group_dequant(xq, xs) @ block_dequant_fp8(weight, weight_scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, weight.shape[0])
