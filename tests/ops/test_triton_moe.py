"""Tests of the fused-MoE Triton kernels, tile-config selection and tuner search space.

CPU: the kernels run under Triton's interpreter in one subprocess (``TRITON_INTERPRET=1`` must be set
before the kernels are defined); inputs are generated here, outputs are compared here against a plain
per-expert torch reference in float64. GPU (``-m gpu``): bf16 at the Qwen1.5-MoE and Qwen3-MoE shapes,
host-sync freedom, and CUDA-graph capture and replay.

Inputs are fresh random each run; the seed is printed in failure messages (set ``MOESERVE_TEST_SEED`` to
replay one).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from moe_cases import random_moe_inputs, random_routing, reference_moe  # noqa: E402
from triton_interpreter import is_worker, patch_for_numpy, run_worker  # noqa: E402

SEED = int(os.environ.get("MOESERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))

FP32_RTOL, FP32_ATOL = 1e-4, 1e-5
FP16_REL_FRO = 3e-3
BF16_REL_FRO = 2e-2
NORM_EPS = 1e-6

CFG_A = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
CFG_B = dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=16, GROUP_SIZE_M=2, num_warps=4, num_stages=2)
CFG_EVEN = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=16, GROUP_SIZE_M=4, num_warps=4, num_stages=2)

# name: (T, E, k, H, I, dtype, config)
MOE_CASES = {
    "T1-default": (1, 8, 2, 72, 40, torch.float32, None),
    "T5-default": (5, 8, 2, 72, 40, torch.float32, None),
    "T33-default": (33, 8, 2, 72, 40, torch.float32, None),
    "T1-A": (1, 8, 2, 72, 40, torch.float32, CFG_A),
    "T33-A": (33, 8, 2, 72, 40, torch.float32, CFG_A),
    "T33-B": (33, 8, 2, 72, 40, torch.float32, CFG_B),
    "T17-k3-even-K": (17, 4, 3, 64, 48, torch.float32, CFG_EVEN),
    "T33-fp16": (33, 8, 2, 72, 40, torch.float16, CFG_A),
    "T0": (0, 8, 2, 72, 40, torch.float32, None),
}
# name: (T, k, E, block_m, ids dtype)
ALIGN_CASES = {
    "T1": (1, 2, 8, 16, torch.int32),
    "T5": (5, 2, 8, 16, torch.int32),
    "T33": (33, 2, 8, 16, torch.int64),
    "T33-bm64": (33, 2, 8, 64, torch.int32),
    "T0": (0, 2, 8, 16, torch.int32),
    "multi-chunk-E8": (600, 2, 8, 16, torch.int32),
    "multi-chunk-E128": (300, 8, 128, 32, torch.int64),
    "T40-E60-bm128": (40, 4, 60, 128, torch.int32),  # padding runs past the first 1024-slot stretch
    "T64-k4-E60": (64, 4, 60, 16, torch.int32),  # 256 ids: the largest one-pass routing of 60 experts
    "T100-k4-E60": (100, 4, 60, 16, torch.int32),  # 400 ids: one program looping over tiles
}
# name: (T, k, H, dtype, shared expert, sigmoid gate): the combine kernel (sum over top-k + gated shared add)
COMBINE_CASES = {
    "T1-k4-gated": (1, 4, 72, torch.float32, True, True),
    "T9-k2-shared": (9, 2, 1100, torch.float32, True, False),  # H > one block of 1024 columns
    "T5-k8-routed-only": (5, 8, 64, torch.float32, False, False),
    "T7-k4-gated-bf16": (7, 4, 96, torch.bfloat16, True, True),
    "T0": (0, 2, 32, torch.float32, True, True),
}
# name: (T, k, H, dtype, shared expert, sigmoid gate): the combine that also adds to the residual and applies
# the next norm (moe_fuse_norm)
COMBINE_NORM_CASES = {
    "T1-k4-gated": (1, 4, 72, torch.float32, True, True),
    "T6-k2-shared-bf16": (6, 2, 96, torch.bfloat16, True, False),
    "T3-k8-routed-only-H1100": (3, 8, 1100, torch.float32, False, False),  # a row wider than 1024 columns
    "T0": (0, 2, 32, torch.float32, True, True),
}
# name: (T, E, k, dtype, config): pairwise tiles (no alignment), as steps of few tokens run; from two tokens on
# the tile of each expert's first pair takes every token routed to it (17 tokens: a 32-row tile)
PAIRWISE_CASES = {
    "T1-k2": (1, 8, 2, torch.float32, None),
    "T3-k4-A": (3, 8, 4, torch.float32, CFG_A),
    "T2-k2-odd-K-fp16": (2, 8, 2, torch.float16, CFG_B),
    "T17-k3-B": (17, 6, 3, torch.float32, CFG_B),
}
# name: (T, E, k, share of ids masked): the row tiles of an expert's first pair (``expert_tile_rows``)
EXPERT_TILE_CASES = {"T3-k4": (3, 8, 4, 0.0), "T17-k3": (17, 6, 3, 0.0), "T16-k8": (16, 64, 8, 0.0),
                     "T9-k2-masked": (9, 4, 2, 0.4)}
# name: (T, E, k): routing with about half the ids -1
MASKED_CASES = {"T1": (1, 8, 2), "T33": (33, 8, 2), "T17-k4": (17, 4, 4)}
# gate/up rows interleaved, the activation in the first GEMM's epilogue (I=40: 2I=80 rows end in a partial tile)
# name: (T, E, k, dtype, config, pairwise, masked ids)
INTERLEAVED_CASES = {
    "T1-pairwise": (1, 8, 2, torch.float32, None, True, False),
    "T3-k4-pairwise-A": (3, 8, 4, torch.float32, CFG_A, True, False),
    "T12-k2-pairwise-B-fp16": (12, 4, 2, torch.float16, CFG_B, True, False),
    "T33-A": (33, 8, 2, torch.float32, CFG_A, False, False),
    "T33-B-fp16": (33, 8, 2, torch.float16, CFG_B, False, False),
    "T17-even-K-masked": (17, 4, 3, torch.float32, CFG_EVEN, False, True),
}
# name: (E, routed k, fixed experts, dtype, config, interleaved): one token whose last ids are always the last
# experts (a fused shared expert's pieces, ``fused_moe``'s ``fixed_tail``): their tiles run first
FIXED_TAIL_CASES = {
    "k3-fixed2": (8, 3, 2, torch.float32, None, False),
    "k2-fixed4-interleaved-A": (10, 2, 4, torch.float32, CFG_A, True),
    "k4-fixed1-interleaved-fp16": (9, 4, 1, torch.float16, CFG_B, True),
}
COMBINE_BF16_TOL = 1e-2  # relative, one bf16 rounding of a float32 sum (2**-8 = 3.9e-3 per element at most)


def check_alignment(sorted_ids, expert_ids, ntpp, topk_ids, block_m, E):
    """Invariants of ``moe_align_block_size``: shapes, each (token, slot) exactly once, one expert per block,
    padding marked with ``numel``, blocks ordered by expert and tokens ordered within an expert."""
    sorted_ids, expert_ids, flat = sorted_ids.cpu().long(), expert_ids.cpu().long(), topk_ids.flatten().cpu().long()
    numel = flat.numel()
    assert sorted_ids.shape == (numel + E * (block_m - 1),)
    assert expert_ids.shape == (sorted_ids.shape[0] // block_m,)
    assert ntpp.shape == (1,) and ntpp.dtype == torch.int32
    total = int(ntpp[0])
    counts = torch.bincount(flat, minlength=E)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    used = sorted_ids[:total]
    real = used[used < numel]
    assert torch.equal(real.sort().values, torch.arange(numel)), "every (token, slot) exactly once"
    assert bool((used[used >= numel] == numel).all()) and bool((sorted_ids[total:] == numel).all())
    nblocks = total // block_m
    blocks = used.view(nblocks, block_m)
    owner = expert_ids[:nblocks]
    valid = blocks < numel
    assert bool(valid[:, 0].all()), "every used block starts with a real token"
    routed = flat[blocks.clamp(max=max(numel - 1, 0))] if numel else blocks
    assert bool((routed[valid] == owner[:, None].expand_as(blocks)[valid]).all()), "one expert per block"
    assert bool((owner[1:] >= owner[:-1]).all()) and bool(((owner >= 0) & (owner < E)).all())
    assert bool((expert_ids[nblocks:] == -1).all())
    for e in owner.unique().tolist():
        toks = blocks[owner == e][valid[owner == e]]
        assert torch.equal(toks, toks.sort().values)


@contextlib.contextmanager
def poisoned_empty():
    """``torch.empty`` returns memory filled with -7 inside the block: the alignment writes its own padding,
    so a slot it leaves unwritten must show up as a wrong value, not as a lucky zero."""
    real = torch.empty

    def empty(*args, **kwargs):
        return real(*args, **kwargs).fill_(-7)
    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


# ---------------------------------------------------------------- CPU: Triton interpreter

def _interpreter_worker(in_path: str, out_path: str) -> None:
    patch_for_numpy()
    from moeserve.ops.moe.combine_triton import moe_combine_triton
    from moeserve.ops.moe.triton_kernels import fused_moe, interleave_gate_up, moe_align_block_size
    inputs = torch.load(in_path)
    from moeserve.ops.moe.combine import AddNorm
    out = {"moe": {}, "align": {}, "combine": {}, "masked": {}, "pairwise": {}, "interleaved": {},
           "combine_norm": {}, "expert_tile": {}, "fixed_tail": {}}
    for name, (ids, k) in inputs["expert_tile"].items():
        numel = ids.numel()
        block_m = max(16, 1 << (numel // k - 1).bit_length())
        rows = torch.full((numel, block_m), -7, dtype=torch.int64)
        owner = torch.full((numel,), -7, dtype=torch.int32)
        expert = torch.full((numel,), -7, dtype=torch.int64)
        _expert_tile_probe[(numel,)](ids, rows, owner, expert, numel, BLOCK_M=block_m, K=k,
                                     KP=1 << (k - 1).bit_length())
        out["expert_tile"][name] = (rows, owner, expert)
    for name, (down, k, shared, gate) in inputs["combine"].items():
        out["combine"][name] = moe_combine_triton(down, k, shared, gate)
    for name, (down, k, shared, gate, residual, weight) in inputs["combine_norm"].items():
        res = residual.clone()
        y = moe_combine_triton(down, k, shared, gate, add_norm=AddNorm(res, weight, NORM_EPS))
        out["combine_norm"][name] = (y, res)
    for name, (x, w13, w2, tw, ti, cfg) in inputs["moe"].items():
        out["moe"][name] = fused_moe(x, w13, w2, tw, ti, config=cfg)
    from moeserve.ops.moe import triton_kernels
    for name, (ids, block_m, E) in inputs["align"].items():
        with poisoned_empty():
            plan = triton_kernels.align_plan(ids.numel(), E)
            default = moe_align_block_size(ids, block_m, E)
            saved, triton_kernels._ALIGN_ONE_PASS_ELEMS = triton_kernels._ALIGN_ONE_PASS_ELEMS, 0
            looped = (triton_kernels.align_plan(ids.numel(), E), moe_align_block_size(ids, block_m, E))
            triton_kernels._ALIGN_ONE_PASS_ELEMS = saved  # above: the same ids through the looping program
        out["align"][name] = (plan, default, looped)
    for name, (x, w13, w2, tw, ti) in inputs["masked"].items():
        out["masked"][name] = fused_moe(x, w13, w2, tw, ti, masked_ids=True)
    for name, (x, w13, w2, tw, ti, cfg) in inputs["pairwise"].items():
        out["pairwise"][name] = fused_moe(x, w13, w2, tw, ti, config=cfg, pairwise_max_tokens=x.shape[0])
    for name, (x, w13, w2, tw, ti, cfg, pairwise, masked) in inputs["interleaved"].items():
        out["interleaved"][name] = fused_moe(x, interleave_gate_up(w13), w2, tw, ti, config=cfg, interleaved=True,
                                             pairwise_max_tokens=x.shape[0] if pairwise else 0, masked_ids=masked)
    for name, (x, w13, w2, tw, ti, cfg, inter, fixed) in inputs["fixed_tail"].items():
        w = interleave_gate_up(w13) if inter else w13
        out["fixed_tail"][name] = [fused_moe(x, w, w2, tw, ti, config=cfg, pairwise_max_tokens=1, interleaved=inter,
                                             fixed_tail=f) for f in (0, fixed)]
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Runs every CPU case under the interpreter in one subprocess; returns ``(inputs, outputs)``."""
    gen = torch.Generator().manual_seed(SEED)
    moe = {}
    for name, (T, E, k, H, I, dtype, cfg) in MOE_CASES.items():
        moe[name] = (*random_moe_inputs(T, E, k, H, I, dtype, gen), cfg)
    align = {}
    for name, (T, k, E, bm, ids_dtype) in ALIGN_CASES.items():
        align[name] = (random_routing(T, E, k, gen, ids_dtype=ids_dtype)[1], bm, E)
    combine = {}
    for name, (T, k, H, dtype, with_shared, gated) in COMBINE_CASES.items():
        down = torch.randn(T * k, H, generator=gen).to(dtype)
        shared = torch.randn(T, H, generator=gen).to(dtype) if with_shared else None
        gate = (torch.randn(T, 1, generator=gen) * 3).to(dtype) if gated else None
        combine[name] = (down, k, shared, gate)
    combine_norm = {}
    for name, (T, k, H, dtype, with_shared, gated) in COMBINE_NORM_CASES.items():
        down = torch.randn(T * k, H, generator=gen).to(dtype)
        shared = torch.randn(T, H, generator=gen).to(dtype) if with_shared else None
        gate = (torch.randn(T, 1, generator=gen) * 3).to(dtype) if gated else None
        residual = (torch.randn(T, H, generator=gen) * 4).to(dtype)
        weight = (1 + 0.5 * torch.randn(H, generator=gen)).to(dtype)
        combine_norm[name] = (down, k, shared, gate, residual, weight)
    masked = {}
    for name, (T, E, k) in MASKED_CASES.items():  # ids of experts held by another rank are -1 (expert parallel)
        x, w13, w2, tw, ti = random_moe_inputs(T, E, k, 72, 40, torch.float32, gen)
        ti = ti.masked_fill(torch.rand(ti.shape, generator=gen) < 0.5, -1)
        masked[name] = (x, w13, w2, tw, ti)
    pairwise = {}
    for name, (T, E, k, dtype, cfg) in PAIRWISE_CASES.items():
        H, I = (72, 40) if "odd-K" in name else (64, 32)
        pairwise[name] = (*random_moe_inputs(T, E, k, H, I, dtype, gen), cfg)
    interleaved = {}
    for name, (T, E, k, dtype, cfg, pw, masked_ids) in INTERLEAVED_CASES.items():
        H, I = (64, 32) if "even-K" in name else (72, 40)
        x, w13, w2, tw, ti = random_moe_inputs(T, E, k, H, I, dtype, gen)
        if masked_ids:
            ti = ti.masked_fill(torch.rand(ti.shape, generator=gen) < 0.5, -1)
        interleaved[name] = (x, w13, w2, tw, ti, cfg, pw, masked_ids)
    expert_tile = {}
    for name, (T, E, k, share) in EXPERT_TILE_CASES.items():
        ids = random_routing(T, E, k, gen)[1]
        expert_tile[name] = (ids.masked_fill(torch.rand(ids.shape, generator=gen) < share, -1).flatten(), k)
    fixed_tail = {}
    for name, (E, k, fixed, dtype, cfg, inter) in FIXED_TAIL_CASES.items():
        x, w13, w2, tw, ti = random_moe_inputs(1, E - fixed, k, 72, 40, dtype, gen)
        _, w13, w2, _, _ = random_moe_inputs(1, E, k, 72, 40, dtype, gen)
        ti = torch.cat([ti, torch.arange(E - fixed, E, dtype=ti.dtype)[None]], 1)
        tw = torch.cat([tw, torch.rand(1, fixed, generator=gen)], 1)
        fixed_tail[name] = (x, w13, w2, tw, ti, cfg, inter, fixed)
    inputs = {"moe": moe, "align": align, "combine": combine, "masked": masked, "pairwise": pairwise,
              "interleaved": interleaved, "combine_norm": combine_norm, "expert_tile": expert_tile,
              "fixed_tail": fixed_tail}
    return inputs, run_worker(__file__, inputs, tmp_path_factory.mktemp("interp"), SEED)


@pytest.mark.parametrize("name", list(COMBINE_NORM_CASES))
def test_moe_combine_with_the_next_norm_interpreter(interpreted, name):
    """The combine with the next norm (``moe_fuse_norm``) against the float64 formula: the MoE sum rounded to
    the dtype as the plain combine stores it, added to the residual (written back in place), RMS-normalised
    and scaled by the weight. float32: within 1e-5; bfloat16: max error under 1.6e-2 of the largest value (two
    roundings)."""
    inputs, outputs = interpreted
    down, k, shared, gate, residual, weight = inputs["combine_norm"][name]
    y, res = outputs["combine_norm"][name]
    T, H = down.shape[0] // k, down.shape[1]
    assert y.shape == res.shape == (T, H) and y.dtype == res.dtype == down.dtype
    moe = down.double().view(T, k, H).sum(1)
    if shared is not None:
        moe = moe + (torch.sigmoid(gate.double()) if gate is not None else 1.0) * shared.double()
    x = moe.to(down.dtype).double() + residual.double()
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * weight.double()
    def check(got, want):
        if down.dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {SEED}: {m}")
        elif T:
            err = float((got.double() - want).abs().max() / want.abs().max())
            assert err < 1.6e-2, f"seed {SEED}: max error {err:.3g} of the largest value"

    check(res, x)
    check(y, ref)
    if T:  # and the reference the CPU engine runs (AddNorm.apply), the same bounds
        from moeserve.ops.moe.combine import AddNorm
        r = residual.clone()
        z = AddNorm(r, weight, NORM_EPS).apply(moe.to(down.dtype))
        check(r, x)
        check(z, ref)


def assert_matches_reference(y, x, ref):
    """A fused-MoE output ``y`` for input ``x`` against the float64 reference: elementwise in float32, by
    relative Frobenius error in 16-bit dtypes."""
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=FP32_RTOL, atol=FP32_ATOL, msg=lambda m: f"seed {SEED}: {m}")
    else:
        err = float((y.double() - ref).norm() / ref.norm())
        assert err < FP16_REL_FRO, f"seed {SEED}: relative Frobenius error {err:.3g}"


@pytest.mark.parametrize("name", list(COMBINE_CASES))
def test_moe_combine_interpreter(interpreted, name):
    """The combine kernel against the float64 formula: sum of the top-k rows + sigmoid(gate) * shared."""
    inputs, outputs = interpreted
    down, k, shared, gate = inputs["combine"][name]
    y = outputs["combine"][name]
    T, H = down.shape[0] // k, down.shape[1]
    assert y.shape == (T, H) and y.dtype == down.dtype
    ref = down.double().view(T, k, H).sum(1)
    if shared is not None:
        ref = ref + (torch.sigmoid(gate.double()) if gate is not None else 1.0) * shared.double()
    if down.dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed {SEED}: {m}")
    else:
        err = float((y.double() - ref).abs().max() / ref.abs().max())
        assert err < COMBINE_BF16_TOL, f"seed {SEED}: max relative error {err:.3g}"


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_fused_moe_interpreter(interpreted, name):
    inputs, outputs = interpreted
    x, w13, w2, tw, ti, _ = inputs["moe"][name]
    y = outputs["moe"][name]
    assert_matches_reference(y, x, reference_moe(x, w13, w2, tw, ti))


@pytest.mark.parametrize("name", list(PAIRWISE_CASES))
def test_pairwise_fused_moe_interpreter(interpreted, name):
    """Steps of few tokens: one row tile per (token, expert) pair, no alignment; the same MoE."""
    inputs, outputs = interpreted
    x, w13, w2, tw, ti, _ = inputs["pairwise"][name]
    y = outputs["pairwise"][name]
    assert_matches_reference(y, x, reference_moe(x, w13, w2, tw, ti))


@pytest.mark.parametrize("name", list(FIXED_TAIL_CASES))
def test_fixed_tail_tiles_first_compute_the_same_moe_interpreter(interpreted, name):
    """One token whose last ids are fixed experts (``fixed_tail``: their tiles first in the grid, the routed
    pairs after them): the same output, bit for bit, as the tiles in pair order, and the MoE of the reference."""
    inputs, outputs = interpreted
    x, w13, w2, tw, ti, _, _, fixed = inputs["fixed_tail"][name]
    plain, early = outputs["fixed_tail"][name]
    assert torch.equal(early, plain), f"seed {SEED}: fixed_tail={fixed} changed the output"
    assert_matches_reference(early, x, reference_moe(x, w13, w2, tw, ti))


def test_fixed_tail_is_refused_outside_one_tokens_pairs():
    from moeserve.ops.moe.triton_kernels import invoke_fused_moe_kernel
    a, b = torch.zeros(1, 8), torch.zeros(4, 16, 8)
    c, ids = torch.zeros(2, 16), torch.zeros(2, dtype=torch.int32)  # one token's two pairs
    for kw in ({"pairwise": False}, {"pairwise": True, "route_k": 2}, {"pairwise": True, "early": 3}):
        with pytest.raises(ValueError, match="early="):
            invoke_fused_moe_kernel(a, b, c, None, ids, ids, ids, 2, CFG_A, **{"early": 1, **kw})


@pytest.mark.parametrize("name", list(EXPERT_TILE_CASES))
def test_each_expert_has_one_tile_of_all_its_tokens_interpreter(interpreted, name):
    """Pairwise steps of several tokens: of the pairs routed to one expert only the first owns a tile, and
    that tile's row ``r`` is token ``r``'s pair with the expert (none where token ``r`` did not pick it), so
    each expert is read once and every pair is computed once; masked ids (-1) own nothing."""
    inputs, outputs = interpreted
    ids, k = inputs["expert_tile"][name]
    rows, owner, expert = outputs["expert_tile"][name]
    numel = ids.numel()
    ids2 = ids.view(-1, k)
    for p in range(numel):
        e = int(ids[p])
        first = int((ids == e).nonzero()[0]) if e >= 0 else numel
        assert int(owner[p]) == first, f"pair {p} (expert {e}): owner {int(owner[p])}, expected {first}"
        assert int(expert[p]) == e
        if e < 0:
            continue
        for r in range(rows.shape[1]):
            hit = (ids2[r] == e).nonzero() if r < ids2.shape[0] else []
            want = r * k + int(hit[0]) if len(hit) else numel
            assert int(rows[p, r]) == want, f"pair {p}, row {r}: {int(rows[p, r])}, expected {want}"
    owners = {int(owner[p]) for p in range(numel) if int(owner[p]) == p}
    assert len(owners) == len({int(e) for e in ids if e >= 0}), "one tile per distinct expert"
    covered = sorted(int(v) for p in owners for v in rows[p] if v < numel)
    assert covered == [p for p in range(numel) if ids[p] >= 0], "every routed pair in exactly one tile"


@pytest.mark.parametrize("name", list(INTERLEAVED_CASES))
def test_interleaved_gate_up_fused_moe_interpreter(interpreted, name):
    """Gate/up rows interleaved and the SwiGLU activation in the first GEMM's epilogue: the same MoE (the
    reference reads the original, gate-then-up weights)."""
    inputs, outputs = interpreted
    x, w13, w2, tw, ti, _, _, masked_ids = inputs["interleaved"][name]
    y = outputs["interleaved"][name]
    if masked_ids:
        tw, ti = tw * (ti >= 0), ti.clamp(min=0)
    assert_matches_reference(y, x, reference_moe(x, w13, w2, tw, ti))


def test_interleave_gate_up_layout_and_the_backend_lays_out_once():
    """Row ``2j`` is gate row ``j``, ``2j + 1`` up row ``j``; ``deinterleave_gate_up`` undoes it. The Triton
    backend's ``prepare`` interleaves a bf16 layer's experts once (and says so in ``w13_order``)."""
    from types import SimpleNamespace

    from moeserve.ops.moe.triton_backend import TritonMoE
    from moeserve.ops.moe.triton_kernels import deinterleave_gate_up, interleave_gate_up
    gen = torch.Generator().manual_seed(SEED)
    w13 = torch.randn(3, 10, 6, generator=gen)
    w = interleave_gate_up(w13)
    assert torch.equal(w[:, 0::2], w13[:, :5]) and torch.equal(w[:, 1::2], w13[:, 5:])
    assert torch.equal(deinterleave_gate_up(w), w13)
    layer = SimpleNamespace(w13=torch.nn.Parameter(w13.clone(), requires_grad=False), w13_scale_inv=None,
                            w13_order="gate_up", fused_shared=0, top_k=2)
    moe = TritonMoE(torch.device("cpu"), torch.float32)
    moe.prepare(layer)
    moe.prepare(layer)
    assert layer.w13_order == "interleaved" and torch.equal(layer.w13, w)


@pytest.mark.parametrize("name", list(MASKED_CASES))
def test_masked_ids_add_nothing(interpreted, name):
    """Expert parallel: ids -1 (another rank's experts) contribute zero, in the kernel and in the torch
    reference alike."""
    from moeserve.ops.moe.torch_ref import torch_moe
    inputs, outputs = interpreted
    x, w13, w2, tw, ti = inputs["masked"][name]
    keep = ti >= 0
    ref = reference_moe(x, w13, w2, tw * keep, ti.clamp(min=0))
    torch.testing.assert_close(outputs["masked"][name].double(), ref, rtol=FP32_RTOL, atol=FP32_ATOL,
                               msg=lambda m: f"seed {SEED}: {m}")
    torch.testing.assert_close(torch_moe(x, w13, w2, tw, ti).double(), ref, rtol=FP32_RTOL, atol=FP32_ATOL)


@pytest.mark.parametrize("name", list(ALIGN_CASES))
def test_align_interpreter(interpreted, name):
    """Each plan's alignment has the invariants; the one-pass program and the looping one give the same slots."""
    inputs, outputs = interpreted
    ids, block_m, E = inputs["align"][name]
    plan, default, (looped_plan, looped) = outputs["align"][name]
    from moeserve.ops.moe.triton_kernels import align_plan
    assert plan == align_plan(ids.numel(), E)
    for sorted_ids, expert_ids, ntpp in (default, looped):
        assert sorted_ids.dtype == torch.int32 and expert_ids.dtype == torch.int32
        check_alignment(sorted_ids, expert_ids, ntpp, ids, block_m, E)
    if plan == "one-pass":
        assert looped_plan in ("single", "chunked")
        assert all(torch.equal(a, b) for a, b in zip(default, looped))


def test_align_plan():
    """The one-pass program takes routings whose one-hot has at most 16384 entries (ids and experts each rounded
    up to a power of two, ids to at least 16); larger ones loop, in one program up to 1024 ids, else in chunks."""
    from moeserve.ops.moe.triton_kernels import align_plan
    assert align_plan(0, 8) == align_plan(1, 60) == align_plan(256, 60) == align_plan(64, 256) == "one-pass"
    assert align_plan(16, 1024) == "one-pass" and align_plan(17, 1024) == "single"
    assert align_plan(257, 60) == align_plan(1024, 60) == align_plan(65, 256) == "single"
    assert align_plan(1025, 60) == "chunked"
    from moeserve.ops.moe.triton_kernels import _one_pass_warps
    assert _one_pass_warps(128, 64) == 4 and _one_pass_warps(129, 64) == 8  # 8 warps above 8192 entries


# ---------------------------------------------------------------- CPU: config selection and tuner

def test_config_file_name():
    from moeserve.ops.moe.triton_configs import config_file_name
    assert (config_file_name(60, 1408, 2048, "bf16", "NVIDIA_H200")
            == "E=60,N=1408,H=2048,device_name=NVIDIA_H200,dtype=bf16.json")
    assert config_file_name(8, 64, 32, "fp16", "cpu", [128, 128]).endswith("dtype=fp16,block_shape=[128,128].json")


def test_get_config_default_and_tuned(tmp_path, monkeypatch):
    from moeserve.ops.moe import triton_configs as tc
    cfg, tuned = tc.get_config(4, 60, 1408, 2048, 4, torch.float32)
    assert set(tc.CONFIG_KEYS) <= set(cfg) and isinstance(tuned, bool)
    table = {"1": dict(tc.default_config(1, 3, 5, 7, 2, torch.bfloat16), BLOCK_SIZE_N=32),
             "64": dict(tc.default_config(64, 3, 5, 7, 2, torch.bfloat16), BLOCK_SIZE_N=256)}
    name = tc.config_file_name(3, 5, 7, "bf16", tc.device_name())
    (tmp_path / name).write_text(json.dumps(table))
    monkeypatch.setenv(tc.CONFIG_DIR_ENV, str(tmp_path))
    tc.load_configs.cache_clear()
    tc._get_config.cache_clear()
    try:
        assert tc.load_configs(3, 5, 7, "bf16", tc.device_name())[64]["BLOCK_SIZE_N"] == 256
        cfg, tuned = tc.get_config(40, 3, 5, 7, 2, torch.bfloat16)
        assert tuned and cfg["BLOCK_SIZE_N"] == 256
        cfg, tuned = tc.get_config(20, 3, 5, 7, 2, torch.bfloat16)
        assert tuned and cfg["BLOCK_SIZE_N"] == 32
        cfg["BLOCK_SIZE_N"] = 0
        assert tc.get_config(20, 3, 5, 7, 2, torch.bfloat16)[0]["BLOCK_SIZE_N"] == 32
        assert not tc.get_config(20, 3, 5, 7, 2, torch.float16)[1]
    finally:
        tc.load_configs.cache_clear()
        tc._get_config.cache_clear()


def test_tuner_search_space():
    from moeserve.ops.moe import tune_triton as tt
    args, shapes = tt.parse_args(["--shapes", "qwen1.5", "qwen3", "--shape", "8,64,32,2", "--budget-s", "5"])
    assert [s[0] for s in shapes] == ["qwen1.5", "qwen3", "E8I64"] and args.batch_sizes == tt.BATCH_SIZES
    for _, (E, I, H, k) in shapes[:2]:
        for M in tt.BATCH_SIZES:
            tiles = tt.tile_candidates(M, E, k, 2, 232448, torch.bfloat16, 24)
            variants = tt.variant_candidates(tiles[:2], M, E, k, 2, 232448)
            assert 0 < len(tiles) <= 24 and len(variants) > 0
            cap = max(16, 2 * 2 ** max(0, (M * k + E - 1) // E - 1).bit_length())
            for c in tiles + variants:
                assert tt.fits(c, 2, 232448) and c["BLOCK_SIZE_M"] <= cap
                assert all(c[key] in vals for key, vals in tt.SPACE.items())


def test_fp8_tuning_keeps_block_k_a_divisor_of_128_and_writes_the_table_the_kernel_loads(tmp_path):
    from moeserve.ops.moe import tune_triton as tt
    from moeserve.ops.moe.fp8_triton import BLOCK_SHAPE, FP8_CONFIG_TAG, default_fp8_config
    args, _ = tt.parse_args(["--shape", "8,256,256,2", "--dtype", FP8_CONFIG_TAG, "--out", str(tmp_path)])
    assert tt.DTYPES[args.dtype] == torch.bfloat16  # activations stay bf16; the experts are e4m3
    from moeserve.ops.moe.triton_configs import config_file_name
    name = config_file_name(8, 256, 256, args.dtype, "NVIDIA_H200", BLOCK_SHAPE)
    assert name == "E=8,N=256,H=256,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
    assert default_fp8_config(64, 8, 256, 256, 2)["BLOCK_SIZE_K"] == 128
    tiles = tt.tile_candidates(64, 8, 2, 1, 232448, torch.bfloat16, 48)
    assert any(not tt.fp8_fits(c) for c in tiles) and any(tt.fp8_fits(c) for c in tiles)


def test_tuner_times_the_layout_the_engine_runs(monkeypatch):
    """bf16 experts are tuned interleaved (activation in the epilogue, steps of up to 16 tokens unaligned) as the
    engine runs them by default; the reference reads the interleaved rows back in gate-then-up order."""
    from moeserve.config import EngineConfig
    from moeserve.ops.moe import tune_triton as tt
    g = torch.Generator().manual_seed(1)
    E, I, H, k, M = 4, 32, 64, 2, 3
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 8).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / 6).bfloat16()
    x = torch.randn(M, H, generator=g).bfloat16()
    tw, ti = torch.softmax(torch.randn(M, k, generator=g), 1), torch.stack([torch.randperm(E, generator=g)[:k]
                                                                             for _ in range(M)]).int()
    marked = tt.interleaved(w13)
    assert not torch.equal(marked.as_subclass(torch.Tensor), w13)
    torch.testing.assert_close(tt.reference(x, marked, w2, tw, ti), tt.reference(x, w13, w2, tw, ti),
                               rtol=0, atol=0)
    calls = []
    monkeypatch.setattr(tt, "fused_moe", lambda x, w13, w2, *a, **kw: calls.append((type(w13), kw)))
    tt.run_moe(x, marked, w2, tw, ti, {})
    tt.run_moe(x, w13, w2, tw, ti, {})
    assert calls[0][0] is torch.Tensor and calls[0][1]["interleaved"]
    assert calls[0][1]["pairwise_max_tokens"] == EngineConfig().moe_pairwise_max_tokens == 16
    assert not calls[1][1]["interleaved"] and calls[1][1]["pairwise_max_tokens"] == 0
    assert not tt.parse_args(["--shapes", "qwen1.5"])[0].gate_then_up


def test_fp8_tuning_reference_matches_the_quantised_computation():
    """The tuner's FP8 reference: dequantised experts, activations quantised per group of 128 as in the kernel."""
    from moeserve.ops.moe import tune_triton as tt
    from moeserve.quant.fp8 import block_quant_fp8
    g = torch.Generator().manual_seed(0)
    E, I, H, k, M = 4, 128, 256, 2, 5
    w13 = torch.randn(E, 2 * I, H, generator=g) / 16
    w2 = torch.randn(E, H, I, generator=g) / 11
    x = torch.randn(M, H, generator=g).bfloat16()
    tw, ti = torch.softmax(torch.randn(M, k, generator=g), 1), torch.stack([torch.randperm(E, generator=g)[:k]
                                                                             for _ in range(M)]).int()
    full = tt.reference(x, w13.bfloat16(), w2.bfloat16(), tw, ti)
    quant = tt.reference(x, block_quant_fp8(w13), block_quant_fp8(w2), tw, ti)
    err = float((quant - full).norm() / full.norm())
    assert 1e-3 < err < 0.1  # close to the unquantised MLP, but not equal to it


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
QWEN_SHAPES = {"qwen1.5": (60, 1408, 2048, 4), "qwen3": (128, 768, 2048, 8)}


@pytest.fixture(scope="module")
def qwen_weights():
    cache = {}

    def get(name):
        if name not in cache:
            cache.clear()
            E, I, H, k = QWEN_SHAPES[name]
            gen = torch.Generator(device="cuda").manual_seed(SEED)
            cache[name] = random_moe_inputs(1, E, k, H, I, torch.bfloat16, gen, "cuda")[1:3]
        return cache[name]

    return get


@gpu
@needs_cuda
@pytest.mark.parametrize("M,pairwise", [(1, False), (1, True), (4, True), (7, False), (16, True), (32, True),
                                        (64, False), (64, True), (512, False)])
@pytest.mark.parametrize("shape", list(QWEN_SHAPES))
@pytest.mark.parametrize("interleaved", [False, True], ids=["gate-up", "interleaved"])
def test_fused_moe_bf16_gpu(qwen_weights, shape, M, pairwise, interleaved):
    from moeserve.ops.moe.triton_kernels import fused_moe, interleave_gate_up
    E, I, H, k = QWEN_SHAPES[shape]
    w13, w2 = qwen_weights(shape)
    gen = torch.Generator(device="cuda").manual_seed(SEED + M)
    x = torch.randn(M, H, generator=gen, device="cuda").bfloat16()
    tw, ti = random_routing(M, E, k, gen, "cuda", torch.int64 if M % 2 else torch.int32)
    w = interleave_gate_up(w13) if interleaved else w13
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = fused_moe(x, w, w2, tw, ti, pairwise_max_tokens=M if pairwise else 0, interleaved=interleaved)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = reference_moe(x, w13, w2, tw, ti, dtype=torch.float32)
    err = float((y.float() - ref).norm() / ref.norm())
    assert y.dtype == torch.bfloat16 and err < BF16_REL_FRO, f"seed {SEED}: rel Frobenius error {err:.3g}"
    if interleaved:  # the same roundings as the separate activation kernel: the unfused path's result, up to the
        plain = fused_moe(x, w13, w2, tw, ti, pairwise_max_tokens=M if pairwise else 0)  # order of MMA sums
        err = float((y.float() - plain.float()).norm() / plain.float().norm())
        assert err < 1e-3, f"seed {SEED}: {err:.3g} from the unfused path"


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cfg", [None, CFG_A, CFG_B], ids=["default", "A", "B"])
def test_fused_moe_small_gpu(dtype, cfg):
    from moeserve.ops.moe.triton_kernels import fused_moe
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    for T in (1, 5, 33):
        x, w13, w2, tw, ti = random_moe_inputs(T, 8, 2, 72, 40, dtype, gen, "cuda")
        y = fused_moe(x, w13, w2, tw, ti, config=cfg)
        ref = reference_moe(x, w13, w2, tw, ti)
        if dtype == torch.float32:
            torch.testing.assert_close(y.double(), ref, rtol=FP32_RTOL, atol=FP32_ATOL)
        else:
            err = float((y.double() - ref).norm() / ref.norm())
            assert err < (FP16_REL_FRO if dtype == torch.float16 else BF16_REL_FRO), f"seed {SEED}: {err:.3g}"


@gpu
@needs_cuda
@pytest.mark.parametrize("T,k,E,block_m", [(1, 8, 128, 16), (32, 4, 60, 16), (64, 4, 60, 32), (128, 4, 60, 16),
                                           (4096, 8, 128, 64), (3000, 4, 60, 128)])
def test_align_gpu(T, k, E, block_m):
    from moeserve.ops.moe.triton_kernels import moe_align_block_size
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    ids = random_routing(T, E, k, gen, "cuda")[1]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with poisoned_empty():
            out = moe_align_block_size(ids, block_m, E)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_alignment(*out, ids, block_m, E)


@gpu
@needs_cuda
@pytest.mark.parametrize("M,pairwise", [(1, False), (1, True), (2, True), (7, False), (16, True), (200, False)])
def test_fused_moe_cuda_graph(qwen_weights, M, pairwise):
    from functools import partial

    from moeserve.ops.moe import triton_kernels
    fused_moe = partial(triton_kernels.fused_moe, pairwise_max_tokens=M if pairwise else 0)
    E, I, H, k = QWEN_SHAPES["qwen3"]
    w13, w2 = qwen_weights("qwen3")
    gen = torch.Generator(device="cuda").manual_seed(SEED + 1000 + M)
    x = torch.randn(M, H, generator=gen, device="cuda").bfloat16()
    tw, ti = random_routing(M, E, k, gen, "cuda")
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, w13, w2, tw, ti, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, w13, w2, tw, ti, out=out)
    for _ in range(3):
        new_x = torch.randn(M, H, generator=gen, device="cuda").bfloat16()
        new_tw, new_ti = random_routing(M, E, k, gen, "cuda")
        x.copy_(new_x)
        tw.copy_(new_tw)
        ti.copy_(new_ti)
        graph.replay()
        eager = fused_moe(new_x, w13, w2, new_tw, new_ti)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        ref = reference_moe(new_x, w13, w2, new_tw, new_ti, dtype=torch.float32)
        assert float((out.float() - ref).norm() / ref.norm()) < BF16_REL_FRO


if __name__ == "__main__" and is_worker(sys.argv):
    import triton
    import triton.language as tl

    from moeserve.ops.moe.triton_kernels import expert_tile_rows

    @triton.jit
    def _expert_tile_probe(ids_ptr, rows_ptr, owner_ptr, expert_ptr, numel, BLOCK_M: tl.constexpr,
                           K: tl.constexpr, KP: tl.constexpr):
        pid = tl.program_id(0)
        rows, expert, owner = expert_tile_rows(ids_ptr, pid, numel, BLOCK_M, K, KP)
        tl.store(rows_ptr + pid * BLOCK_M + tl.arange(0, BLOCK_M), rows)
        tl.store(owner_ptr + pid, owner)
        tl.store(expert_ptr + pid, expert)

    _interpreter_worker(sys.argv[2], sys.argv[3])


@gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 8, 64])
def test_fused_moe_with_a_shared_expert_on_a_side_stream_in_a_cuda_graph(qwen_weights, M):
    """Qwen1.5's MoE: the shared expert's output (made on a side stream, joined before the combine) and its
    sigmoid gate are added in the combine kernel, captured in a CUDA graph; against the float32 formula."""
    from moeserve.ops.moe.combine import SharedExpertOutput
    from moeserve.ops.moe.triton_kernels import fused_moe
    E, I, H, k = QWEN_SHAPES["qwen1.5"]
    w13, w2 = qwen_weights("qwen1.5")
    gen = torch.Generator(device="cuda").manual_seed(SEED + 2000 + M)
    x = torch.randn(M, H, generator=gen, device="cuda").bfloat16()
    tw, ti = random_routing(M, E, k, gen, "cuda")
    w_shared = (torch.randn(H, H, generator=gen, device="cuda") / H ** 0.5).bfloat16()
    w_gate = (torch.randn(1, H, generator=gen, device="cuda") / H ** 0.5).bfloat16()
    side = torch.cuda.Stream()
    out = torch.empty_like(x)

    def step():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            shared = SharedExpertOutput(x @ w_shared.T, None, side)
        shared.gate_logit = x @ w_gate.T
        fused_moe(x, w13, w2, tw, ti, out=out, shared=shared)

    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        step()  # warm-up (compiles) outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture):
            step()
    torch.cuda.current_stream().wait_stream(capture)
    new_x = torch.randn(M, H, generator=gen, device="cuda").bfloat16()
    x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    xf = new_x.float()
    ref = (reference_moe(new_x, w13, w2, tw, ti, dtype=torch.float32)
           + torch.sigmoid(xf @ w_gate.float().T) * (xf @ w_shared.float().T))
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < BF16_REL_FRO, f"seed {SEED}: rel Frobenius error {err:.3g}"


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 7, 64])
def test_combine_with_the_next_norm_matches_combine_then_flashinfer_norm(T):
    """``moe_fuse_norm`` on the GPU: the combine with the next norm (one kernel, launched with PDL where the
    step is small enough) against the plain combine followed by FlashInfer's ``fused_add_rmsnorm``, bfloat16,
    Qwen1.5's hidden size, shared expert gated: the new residual bit for bit (the same float32 sums, rounded
    once), the normalised output within 1e-2 of its largest value (the sum of squares in another order)."""
    import flashinfer.norm

    from moeserve.ops import pdl
    from moeserve.ops.moe.combine import AddNorm
    from moeserve.ops.moe.combine_triton import moe_combine_triton
    H, k = 2048, 4
    gen = torch.Generator(device="cuda").manual_seed(SEED + 3000 + T)
    down = torch.randn(T * k, H, generator=gen, device="cuda").bfloat16()
    shared = torch.randn(T, H, generator=gen, device="cuda").bfloat16()
    gate = torch.randn(T, 1, generator=gen, device="cuda").bfloat16() * 3
    residual = (torch.randn(T, H, generator=gen, device="cuda") * 4).bfloat16()
    weight = (1 + 0.5 * torch.randn(H, generator=gen, device="cuda")).bfloat16()
    with pdl.enabled_as(64):
        res = residual.clone()
        y = moe_combine_triton(down, k, shared, gate, add_norm=AddNorm(res, weight, NORM_EPS))
        plain = moe_combine_triton(down, k, shared, gate)
    ref_res = residual.clone()
    flashinfer.norm.fused_add_rmsnorm(plain, ref_res, weight, NORM_EPS)  # plain becomes the norm, in place
    torch.cuda.synchronize()
    torch.testing.assert_close(res, ref_res, rtol=0, atol=0, msg=lambda m: f"seed {SEED}: the residual: {m}")
    err = float((y.float() - plain.float()).abs().max() / plain.float().abs().max())
    assert err < 1e-2, f"seed {SEED}: max error {err:.3g} of the largest value"

