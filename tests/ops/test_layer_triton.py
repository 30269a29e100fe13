"""The one-token attention half in one persistent kernel (``moeserve.ops.attention.layer_triton``) against its torch
reference (the kernel-by-kernel path's arithmetic): on the CPU under Triton's interpreter its four phases as four
launches (float32, one subprocess); on a GPU (``-m gpu``) in bf16 at the Qwen1.5-MoE and Qwen3-MoE shapes, the
fused kernel with its grid barriers against the reference and against the phases launched one by one, replayed
many times in a CUDA graph (the barrier words must come back to rest, the outputs must not change), and inside
a CUDA graph replayed at a new position.

Each case is one request whose pages are scattered over the cache; the whole cache is compared, so a write to a
wrong slot fails too. Inputs are fresh random each run; the seed is in failure messages (``MOESERVE_TEST_SEED``
replays one).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from triton_interpreter import is_worker, patch_for_numpy, run_worker  # noqa: E402

SEED = int(os.environ.get("MOESERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
FP32_TOL = dict(rtol=2e-4, atol=2e-5)
BF16_REL = 2e-2  # relative Frobenius error of bf16 results against the float32-weighted reference

# name: (hidden, Hq, Hkv, D, rotary dim, q/k norm, page size, cached keys, QKV bias, router rows, SMs)
CASES = {
    "mha-bias-router": (64, 4, 4, 32, 32, False, 4, 150, True, 9, 16),
    "gqa-norm": (96, 8, 2, 32, 32, True, 4, 5, False, 0, 6),
    "partial-rotary": (64, 4, 2, 32, 16, True, 8, 0, True, 16, 16),
}


def make_case(spec, dtype, gen, device="cpu", num_pages=64, max_pos=256):
    """The arguments of ``attention_half`` (without the workspace) and its keyword ``router``."""
    h, hq, hkv, d, rot, norm, page, cached, bias, rrows, _ = spec
    nqkv = (hq + 2 * hkv) * d

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    n_pages = -(-(cached + 1) // page)
    free = torch.randperm(num_pages - 1, generator=gen).add(1)[:n_pages].to(torch.int32)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    args = [rnd(1, h), rnd(1, h), rnd(h, scale=0.5).add(1), rnd(nqkv, h, scale=h ** -0.5),
            rnd(nqkv, scale=0.1) if bias else None, rnd(h, hq * d, scale=(hq * d) ** -0.5), rnd(h, scale=0.5).add(1),
            1e-6, i32([cached]), torch.randn(max_pos, rot, generator=gen).float(), hq, hkv, d,
            rnd(num_pages, 2, page, hkv, d), i32([cached]), free, i32([0, n_pages]),
            rnd(d, scale=0.5).add(1) if norm else None, rnd(d, scale=0.5).add(1) if norm else None, 1e-5, d ** -0.5]
    router = rnd(rrows, h, scale=h ** -0.5) if rrows else None
    move = lambda a: a.to(device) if isinstance(a, torch.Tensor) else a  # noqa: E731
    return [move(a) for a in args], move(router)


def _copy(args):
    """Fresh copies of what the kernel writes (residual, cache)."""
    a = list(args)
    a[1], a[13] = args[1].clone(), args[13].clone()
    return a


def _workspace(spec, dtype, device, sms=None):
    from moeserve.ops.attention.layer_triton import LayerWorkspace
    h, hq, hkv, d = spec[:4]
    return LayerWorkspace(h, hq, hkv, d, dtype, torch.device(device), num_sms=sms or spec[10])


# ---------------------------------------------------------------- CPU: Triton interpreter

# the kernel's options besides its defaults: the attention's inputs, the norm and router weights read after the
# barriers instead of before, and part of the output projection's rows from registers loaded ahead of it
OTHER_OPTIONS = {"PRE_ATTN": False, "PRE_NEXT": False, "O_PRE": 64}


def _interpreter_worker(in_path: str, out_path: str) -> None:
    patch_for_numpy()
    from moeserve.ops.attention.layer_triton import attention_half, layer_config
    out = {}
    for name, (spec, args, router) in torch.load(in_path).items():
        for options, extra in (("default", {}), ("other-options", OTHER_OPTIONS)):
            a = _copy(args)
            ws = _workspace(spec, torch.float32, "cpu")
            h_, hq, hkv, d = spec[:4]
            config = dict(layer_config(h_, (hq + 2 * hkv) * d, hq * d, ws.num_sms), **extra)
            h, parts = attention_half(*a, workspace=ws, router=router, phased=True, config=config)
            out[(name, options)] = (h, parts, a[1], a[13], ws.counter.clone())
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    gen = torch.Generator().manual_seed(SEED)
    inputs = {name: (spec, *make_case(spec, torch.float32, gen)) for name, spec in CASES.items()}
    return inputs, run_worker(__file__, inputs, tmp_path_factory.mktemp("layer"), SEED)


@pytest.mark.parametrize("options", ["default", "other-options"])
@pytest.mark.parametrize("name", list(CASES))
def test_phases_match_the_reference_under_the_interpreter(interpreted, name, options):
    from moeserve.ops.attention.layer_triton import attention_half_reference
    inputs, outputs = interpreted
    spec, args, router = inputs[name]
    h, parts, residual, cache, counter = outputs[(name, options)]
    assert not counter.any(), "the merge counters must be back at zero"
    ref_args = _copy(args)
    ref_h, ref_logits = attention_half_reference(*ref_args, router=router)
    msg = lambda what: lambda m: f"seed {SEED}, {name}, {options}: {what}: {m}"  # noqa: E731
    torch.testing.assert_close(h, ref_h, **FP32_TOL, msg=msg("norm output"))
    torch.testing.assert_close(residual, ref_args[1], **FP32_TOL, msg=msg("residual"))
    torch.testing.assert_close(cache, ref_args[13], **FP32_TOL, msg=msg("cache"))
    assert not torch.equal(cache, args[13]), "the new key and value were not written"
    assert not torch.equal(residual, args[1]), "the residual was not updated"
    if router is None:
        assert parts is None
    else:
        n = router.shape[0]
        assert parts.shape == (1, 1, max(16, 1 << (n - 1).bit_length()))
        torch.testing.assert_close(parts[0, :, :n], ref_logits, **FP32_TOL, msg=msg("router logits"))
        assert not parts[0, 0, n:].any(), "rows past the router's must be zero"


def test_the_cases_cover_splits_without_keys_and_a_request_without_history():
    from moeserve.ops.attention.layer_triton import BLOCK_KEYS
    ws = {name: _workspace(spec, torch.float32, "cpu") for name, spec in CASES.items()}
    assert any(spec[7] == 0 for spec in CASES.values())
    # more keys than one tile, split over several programs, some of which get none
    assert any(spec[7] + 1 > BLOCK_KEYS and ws[n].nsplit > 1 for n, spec in CASES.items())
    assert any(ws[n].nsplit * BLOCK_KEYS > spec[7] + 1 for n, spec in CASES.items())


def test_bad_inputs_are_refused_by_name():
    from moeserve.ops.attention.layer_triton import attention_half
    spec = CASES["mha-bias-router"]
    args, router = make_case(spec, torch.float32, torch.Generator().manual_seed(0))
    ws = _workspace(spec, torch.float32, "cpu")
    bad = list(args)
    bad[3] = args[3][:-1]
    with pytest.raises(ValueError, match="attention_half: one token"):
        attention_half(*bad, workspace=ws)
    other = _workspace(CASES["gqa-norm"], torch.float32, "cpu")
    with pytest.raises(ValueError, match="attention_half: the workspace was made for other shapes"):
        attention_half(*args, workspace=other)
    with pytest.raises(ValueError, match="attention_half: router"):
        attention_half(*args, workspace=ws, router=torch.zeros(40, spec[0]))  # 64 rows > 16 programs
    half = list(args)
    half[17] = torch.ones(spec[3])
    with pytest.raises(ValueError, match="q_norm and k_norm go together"):
        attention_half(*half, workspace=ws)


if __name__ == "__main__" and is_worker(sys.argv):
    _interpreter_worker(sys.argv[2], sys.argv[3])


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Qwen1.5-MoE (MHA 16/16, QKV bias, 60 experts + the shared expert's gate in the router: 64 rows) and Qwen3-MoE
# (GQA 32/4, q/k norm, 128 router rows)
GPU_CASES = {
    "qwen1.5-560": (2048, 16, 16, 128, 128, False, 16, 560, True, 64, None),
    "qwen1.5-0": (2048, 16, 16, 128, 128, False, 16, 0, True, 64, None),
    "qwen3-1000": (2048, 32, 4, 128, 128, True, 16, 1000, False, 128, None),
}


def _gpu_case(spec, gen):
    from moeserve.ops.basic import rope_cos_sin_cache
    args, router = make_case(spec, torch.bfloat16, gen, "cuda", num_pages=256, max_pos=2048)
    args[9] = rope_cos_sin_cache(spec[4], 2048, 1e6, None, torch.device("cuda"))
    return args, router


def _at_rest(ws, flip: bool) -> bool:
    """The barrier word's low bits back at zero (one word whose top bit each barrier flips), or the arrival
    counter at zero (a counter and a generation word)."""
    return (ws.sync[0].item() & 0x7FFFFFFF) == 0 if flip else ws.sync[0].item() == 0


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item()


@gpu
@needs_cuda
@pytest.mark.parametrize("variant", [{}, {"num_stages": 4, "QKV_BK": 128},
                                     {**OTHER_OPTIONS, "O_PRE": 1024, "FLIP": False}],
                         ids=["default", "other-tiles", "other-options"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_fused_kernel_matches_the_reference_and_its_phases(name, variant):
    from moeserve.ops.attention.layer_triton import attention_half, attention_half_reference, layer_config
    from moeserve.ops.pdl import enabled_as
    spec = GPU_CASES[name]
    args, router = _gpu_case(spec, torch.Generator().manual_seed(SEED))
    ws = _workspace(spec, torch.bfloat16, "cuda", sms=torch.cuda.get_device_properties(0).multi_processor_count)
    h_, hq, hkv, d = spec[:4]
    config = dict(layer_config(h_, (hq + 2 * hkv) * d, hq * d, ws.num_sms), **variant)
    ref_args, phased_args = _copy(args), _copy(args)
    ref_h, ref_logits = attention_half_reference(*ref_args, router=router)
    ph_h, ph_parts = attention_half(*phased_args, workspace=ws, router=router, phased=True, config=config)
    for pdl in (0, 1):
        a = _copy(args)
        with enabled_as(pdl):
            h, parts = attention_half(*a, workspace=ws, router=router, config=config)
        torch.cuda.synchronize()
        where = f"seed {SEED}, {name}, pdl {pdl}"
        # the same kernel, phases with barriers or launches between them: the same bits
        assert torch.equal(h, ph_h) and torch.equal(a[1], phased_args[1]), f"{where}: fused != phased"
        assert torch.equal(a[13], phased_args[13]) and torch.equal(parts, ph_parts), f"{where}: fused != phased"
        assert _rel(h, ref_h) < BF16_REL, f"{where}: norm output {_rel(h, ref_h):.4f}"
        assert _rel(a[1], ref_args[1]) < BF16_REL, f"{where}: residual"
        assert _rel(a[13], ref_args[13]) < 1e-3, f"{where}: cache {_rel(a[13], ref_args[13]):.5f}"
        assert _rel(parts[0, :, :router.shape[0]], ref_logits) < BF16_REL, f"{where}: router logits"
    assert _at_rest(ws, config["FLIP"]) and not ws.counter.any(), "the barrier and merge counters must be at rest"


@gpu
@needs_cuda
def test_graph_replays_are_stable_and_follow_the_position():
    """Captured once, replayed 200 times on the same inputs: the barrier words come back to rest (an arrival
    word left off its rest would deadlock or break a later replay) and every replay gives the same bits; then
    replayed at the next position, it matches the reference there."""
    from moeserve.ops.attention.layer_triton import attention_half, attention_half_reference
    from moeserve.ops.pdl import enabled_as
    spec = GPU_CASES["qwen1.5-560"]
    args, router = _gpu_case(spec, torch.Generator().manual_seed(SEED))
    ws = _workspace(spec, torch.bfloat16, "cuda", sms=torch.cuda.get_device_properties(0).multi_processor_count)
    hidden, residual0 = args[0], args[1].clone()
    a = _copy(args)
    with enabled_as(1):
        attention_half(*a, workspace=ws, router=router)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            h, parts = attention_half(*a, workspace=ws, router=router)
    word0 = ws.sync[0].item()
    outs = []
    for _ in range(200):
        a[1].copy_(residual0)
        g.replay()
        outs.append((h.clone(), parts.clone()))
    torch.cuda.synchronize()
    assert ws.sync[0].item() == word0 and _at_rest(ws, True), "three barriers per launch, 600 flips"
    assert all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs)
    # the next position of the same request (one more key cached)
    for t in (a[8], a[14]):
        t.add_(1)
    a[1].copy_(residual0)
    ref_args = _copy(a)
    g.replay()
    torch.cuda.synchronize()
    ref_h, _ = attention_half_reference(*ref_args, router=router)
    assert _rel(h, ref_h) < BF16_REL, f"seed {SEED}: after the position moved {_rel(h, ref_h):.4f}"
    assert ws.sync[0].item() == word0 ^ -0x80000000, "one launch more: three flips more"
    assert hidden.data_ptr() == a[0].data_ptr()
