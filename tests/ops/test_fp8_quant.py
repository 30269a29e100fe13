"""Block-FP8 quantisers and the torch FP8 references, on CPU.

Error bounds, measured with these quantisers on N(0, 1) data (relative Frobenius error |out - ref| / |ref|):
weights 128x128 blocks 2.6e-2-2.7e-2, activations 1x128 2.6e-2, W8A8 linear 3.6e-2, W8A8 SwiGLU MoE (two
GEMMs, the SwiGLU output re-quantised) 6.3e-2-6.5e-2. The asserted bounds leave headroom above those:
3.5e-2, 3.5e-2, 5e-2, 8e-2. Per element, e4m3 rounding is at most 2^-4 relative for normal numbers and
2^-10 of the block scale for subnormal ones.
"""
import pytest
import torch

from moeserve.quant.fp8 import (FP8_DTYPE, FP8_MAX, block_dequant_fp8, block_quant_fp8, block_scale_shape,
                                fp8_linear_reference, per_token_group_dequant, per_token_group_quant_fp8)
from moeserve.quant.moe_ref import fp8_moe_reference

WEIGHT_REL = 3.5e-2
ACT_REL = 3.5e-2
LINEAR_REL = 5e-2
MOE_REL = 8e-2


def rel(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("n, k", [(256, 512), (300, 200), (1, 7), (129, 130), (128, 128)])
def test_block_quant_round_trip(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g) * 0.02
    q, s = block_quant_fp8(w)
    assert q.dtype == FP8_DTYPE and q.shape == (n, k)
    assert s.dtype == torch.float32 and tuple(s.shape) == block_scale_shape(n, k) == (-(-n // 128), -(-k // 128))
    # every block's largest magnitude lands exactly on the e4m3 maximum
    assert torch.equal(q.float().abs().amax(), torch.tensor(FP8_MAX))
    deq = block_dequant_fp8(q, s)
    err = (deq - w).abs()
    per_elem_scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    assert bool((err <= w.abs() * 2 ** -4 + per_elem_scale * 2 ** -10 + 1e-12).all())
    if n * k >= 128 * 128:
        assert rel(deq, w) < WEIGHT_REL


def test_block_quant_is_exact_on_representable_weights():
    g = torch.Generator().manual_seed(3)
    q0 = (torch.randn(200, 300, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE)
    q0[::128, ::128] = 448.0  # each block holds the maximum, so its scale is recovered exactly
    s0 = torch.tensor([[0.5, 0.25, 2.0], [1.0, 0.125, 4.0]])
    q, s = block_quant_fp8(block_dequant_fp8(q0, s0))
    assert torch.equal(s, s0) and torch.equal(q.float(), q0.float())


def test_zero_block_quantises_without_nan():
    w = torch.zeros(130, 256)
    w[129, 255] = 3.0
    q, s = block_quant_fp8(w)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.equal(block_dequant_fp8(q, s), w)


def test_stacked_expert_quant_matches_per_expert():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 260, 140, generator=g)
    q, s = block_quant_fp8(w)
    assert s.shape == (3, 3, 2)
    for e in range(3):
        qe, se = block_quant_fp8(w[e])
        assert torch.equal(q[e].float(), qe.float()) and torch.equal(s[e], se)


def test_dequant_rejects_wrong_scale_shape():
    q, s = block_quant_fp8(torch.randn(256, 256))
    with pytest.raises(ValueError, match=r"block scale shape \[2, 3\] does not fit a weight of shape \[256, 256\]"):
        block_dequant_fp8(q, torch.ones(2, 3))


@pytest.mark.parametrize("k", [128, 1000, 64])
def test_per_token_group_quant(k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(33, k, generator=g) * 3
    x[5] = 0.0  # an all-zero token gets a tiny positive scale, not a NaN
    q, s = per_token_group_quant_fp8(x)
    groups = -(-k // 128)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and s.shape == (33, groups)
    padded = torch.nn.functional.pad(x, (0, groups * 128 - k)).view(33, groups, 128)
    torch.testing.assert_close(s, padded.abs().amax(-1).clamp_min(1e-10) / FP8_MAX, rtol=0, atol=0)
    deq = per_token_group_dequant(q, s)
    assert torch.isfinite(deq).all() and torch.equal(deq[5], x[5])
    assert bool(((deq - x).abs() <= x.abs() * 2 ** -4 + s.repeat_interleave(128, 1)[:, :k] * 2 ** -10).all())
    assert rel(deq, x) < ACT_REL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_reference_close_to_full_precision(dtype):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 17, 512, generator=g)
    w = torch.randn(384, 512, generator=g) / 512 ** 0.5
    b = torch.randn(384, generator=g)
    q, s = block_quant_fp8(w)
    y = fp8_linear_reference(x.to(dtype), q, s, b.to(dtype))
    assert y.shape == (2, 17, 384) and y.dtype == dtype
    ref = x @ w.t()
    assert rel(y.float() - b, ref) < LINEAR_REL
    # exactly what the kernels compute: quantised activations times dequantised weights
    xq, xs = per_token_group_quant_fp8(x.reshape(-1, 512))
    exact = per_token_group_dequant(xq, xs) @ block_dequant_fp8(q, s).t()
    if dtype == torch.float32:
        torch.testing.assert_close(y.reshape(-1, 384) - b, exact, rtol=1e-5, atol=1e-5)


def _moe_ref(x, w13, w2, tw, ti):
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ti.long() == e)
        h = x[tok].double() @ w13[e].double().T
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, (h @ w2[e].double().T) * tw[tok, slot, None].double())
    return out


@pytest.mark.parametrize("T, E, k, H, I", [(64, 8, 2, 512, 256), (33, 16, 4, 256, 160)])
def test_fp8_moe_reference_close_to_full_precision(T, E, k, H, I):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    ti = torch.rand(T, E, generator=g).argsort(1)[:, :k].to(torch.int32)
    tw = torch.softmax(torch.randn(T, k, generator=g), 1)
    q13, s13 = block_quant_fp8(w13)
    q2, s2 = block_quant_fp8(w2)
    ref = _moe_ref(x, w13, w2, tw, ti)
    for dtype in (torch.float32, torch.bfloat16):
        y = fp8_moe_reference(x.to(dtype), q13, s13, q2, s2, tw, ti)
        assert y.dtype == dtype and rel(y, ref) < MOE_REL
    # the same weights dequantised, without activation quantisation, are closer still: the activation
    # groups matter, so the reference really quantises them
    y_weight_only = _moe_ref(x, block_dequant_fp8(q13, s13), block_dequant_fp8(q2, s2), tw, ti)
    assert rel(y_weight_only, ref) < rel(fp8_moe_reference(x, q13, s13, q2, s2, tw, ti), ref)
