"""A one-token step's QKV GEMV and decode attention in one grid (``moeserve.ops.attention.qkv_gemv_triton``) against
the two kernels it replaces (``linear_triton.gemv``, then ``decode_triton.qkv_decode_attention``) and the torch
reference: on the CPU under Triton's interpreter (float16, one subprocess; the interpreter runs the programs in order,
so every split finds its head's rows written), on a GPU (``-m gpu``) in bf16 at Qwen1.5-MoE's attention shape,
eagerly and replayed in a CUDA graph with PDL.

Both GEMV forms (``TILES``: ``"dot"``, ``"row"``) run; the split count is varied through the workspace's SM count
and capped (``MAX_SPLITS_IN_GRID``), and the grid runs with ``FOUR_PER_SM`` too;
each call runs twice on one workspace (its counters must be back at zero). The whole cache is compared, so a write
to a wrong slot fails too. Inputs are fresh random each run; the seed is in failure messages.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from graph_capture import capture_with_pdl  # noqa: E402
from test_qkv_triton import make_case  # noqa: E402
from triton_interpreter import is_worker, patch_for_numpy, run_worker  # noqa: E402

SEED = int(os.environ.get("MOESERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
FP16_TOL = dict(rtol=2e-3, atol=2e-3)  # a rounding of fp16 results, summed in another order
BF16_REL = 1e-2  # relative Frobenius error of bf16 results

# name: (Hq, Hkv, D, rotary dim, q/k norm, page size, [(cached, 1)], hidden size K, bias)
CASES = {
    "mha-bias": (4, 4, 32, 32, False, 4, [(137, 1)], 256, True),
    "gqa-norm": (8, 2, 32, 32, True, 4, [(45, 1)], 96, False),
    "first-token": (4, 2, 32, 16, True, 8, [(0, 1)], 256, True),
}
SMS = [1, 8, 128]  # the workspace's SM count: 1 split, a few, 16


def _case(spec, gen, device="cpu", dtype=torch.float16, num_pages=48, max_pos=256):
    """``(x, weight, bias, decode args)``: one token's hidden row, the QKV weight and bias, and ``make_case``'s
    arguments of the step without the batch indices (its qkv is replaced by the projection)."""
    args = make_case(spec[:7], dtype, gen, device, num_pages=num_pages, max_pos=max_pos)
    hq, hkv, d, k = spec[0], spec[1], spec[2], spec[7]
    n = (hq + 2 * hkv) * d
    x = torch.randn(1, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype).to(device)
    b = (torch.randn(n, generator=gen) * 0.1).to(dtype).to(device) if spec[8] else None
    return x, w, b, args[:7] + args[8:]


def _two_kernels(x, w, b, dargs, scale, ws, tiles):
    """The path the grid replaces: the GEMV with the same tiles, then the one-kernel decode attention."""
    from moeserve.ops.attention.decode_triton import qkv_decode_attention
    from moeserve.ops.linear_triton import gemv
    qkv = gemv(x, w, b, config=tiles)
    out = qkv_decode_attention(qkv, *dargs[1:], eps=1e-6, scale=scale, workspace=ws)
    return qkv, out


def _interpreter_worker(in_path: str, out_path: str) -> None:
    patch_for_numpy()
    from moeserve.ops.attention import qkv_gemv_triton as qg
    from moeserve.ops.attention.decode_triton import DecodeWorkspace
    out = {}
    for (name, sms, form), (x, w, b, dargs, scale) in torch.load(in_path).items():
        qg.TILES = form
        hq, hkv, d = dargs[3], dargs[4], dargs[5]
        ws = DecodeWorkspace(8, hq, hkv, d, torch.device("cpu"), num_sms=sms)

        def grid(qkv=None):
            """The grid on a fresh copy of the cache: its output, the cache, and the workspace's counters after it
            (a small spin limit: a head whose counter never filled would end the kernel at once, not hang)."""
            cache = dargs[6].clone()
            o = qg.qkv_gemv_decode_attention(x, w, b, dargs[1], dargs[2], hq, hkv, d, cache, *dargs[7:12],
                                             eps=1e-6, scale=scale, workspace=ws, qkv=qkv, spin_limit=100)
            return o, cache, ws.counter.clone(), ws.rows_done.clone()
        runs = []
        for _ in range(2):  # twice on one workspace: the counters must be back at zero in between
            qkv = torch.full((1, w.shape[0]), float("nan"), dtype=w.dtype)
            o, cache, counter, rows_done = grid(qkv)
            runs.append((o, qkv, cache, counter, rows_done))
        qg.MAX_SPLITS_IN_GRID = 3  # fewer splits than the workspace's SMs give (where they give more)
        capped = grid()
        qg.MAX_SPLITS_IN_GRID = None
        qg.FOUR_PER_SM = True  # (a launch option and fewer GEMV stages: the same results)
        four, four_cache, counter, rows_done = grid()
        qg.FOUR_PER_SM = False
        runs.append((four, runs[0][1], four_cache, counter, rows_done))
        tiles = {k: v for k, v in qg.tiles().items() if k != "row" or v}
        apart_cache = dargs[6].clone()
        apart = _two_kernels(x, w, b, [None, dargs[1], dargs[2], hq, hkv, d, apart_cache, *dargs[7:]], scale, ws,
                             tiles)
        out[(name, sms, form)] = (runs, apart, apart_cache, capped)
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    gen = torch.Generator().manual_seed(SEED)
    inputs = {}
    for name, spec in CASES.items():
        x, w, b, dargs = _case(spec, gen)
        for sms in SMS:
            for form in ("dot", "row"):
                inputs[(name, sms, form)] = (x, w, b, dargs, spec[2] ** -0.5)
    return inputs, run_worker(__file__, inputs, tmp_path_factory.mktemp("qkv-gemv"), SEED)


@pytest.mark.parametrize("form", ["dot", "row"])
@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("name", list(CASES))
def test_one_grid_follows_the_two_kernels_under_the_interpreter(interpreted, name, sms, form):
    """The projection and the output as the two kernels give them (the same arithmetic: bit for bit), the same
    keys and values in the same slots, both within fp16 tolerance of the torch reference; the counters at zero."""
    from moeserve.ops.attention.decode_triton import decode_attention_reference
    inputs, outputs = interpreted
    x, w, b, dargs, scale = inputs[(name, sms, form)]
    runs, (apart_qkv, apart_out), apart_cache, capped = outputs[(name, sms, form)]
    msg = f"seed {SEED}, {name}, sms {sms}, {form}"
    for o, qkv, cache, counter, rows_done in runs:
        assert torch.equal(qkv, apart_qkv), f"{msg}: the projection differs from the GEMV's"
        assert torch.equal(o, apart_out), f"{msg}: the output differs from the two kernels'"
        assert torch.equal(cache, apart_cache), f"{msg}: the cache differs from the two kernels'"
        assert not counter.any() and not rows_done.any(), f"{msg}: counters not back at zero"
    ref_qkv = (x.float() @ w.float().T + (b.float() if b is not None else 0)).to(x.dtype)
    torch.testing.assert_close(runs[0][1], ref_qkv, **FP16_TOL, msg=lambda m: f"{msg}: projection: {m}")
    ref_cache = dargs[6].clone()
    ref = decode_attention_reference(ref_qkv, dargs[1], dargs[2], *dargs[3:6], ref_cache, *dargs[7:12], eps=1e-6,
                                     scale=scale)
    torch.testing.assert_close(runs[0][0], ref, **FP16_TOL, msg=lambda m: f"{msg}: output: {m}")
    torch.testing.assert_close(runs[0][2], ref_cache, **FP16_TOL, msg=lambda m: f"{msg}: cache: {m}")
    assert not torch.equal(runs[0][2], dargs[6]), "no key was written"
    # at most 3 splits a head (MAX_SPLITS_IN_GRID): the reference's output and cache, the counters at zero
    torch.testing.assert_close(capped[0], ref, **FP16_TOL, msg=lambda m: f"{msg}: 3 splits at most: {m}")
    torch.testing.assert_close(capped[1], ref_cache, **FP16_TOL, msg=lambda m: f"{msg}: 3 splits at most: {m}")
    assert not capped[2].any() and not capped[3].any(), f"{msg}: 3 splits at most: counters not back at zero"


def test_inputs_it_does_not_take_are_named():
    from moeserve.ops.attention.decode_triton import DecodeWorkspace
    from moeserve.ops.attention.qkv_gemv_triton import qkv_gemv_decode_attention, unsupported_reason
    gen = torch.Generator().manual_seed(0)
    x, w, b, dargs = _case(CASES["mha-bias"], gen)
    ws = DecodeWorkspace(8, 4, 4, 32, torch.device("cpu"), num_sms=8)
    cos = dargs[2]
    assert unsupported_reason(x, w, b, 4, 4, 32, cos, ws) is None
    assert "one contiguous row" in unsupported_reason(torch.cat([x, x]), w, b, 4, 4, 32, cos, ws)
    assert "QKV weight" in unsupported_reason(x, w[:-32], b, 4, 4, 32, cos, ws)
    assert "bf16 or fp16" in unsupported_reason(x.float(), w.float(), None, 4, 4, 32, cos, ws)
    assert "bias" in unsupported_reason(x, w, b[:-1], 4, 4, 32, cos, ws)
    assert "multiple of the GEMV's" in unsupported_reason(x, torch.zeros(24 * 12, 256).half(), None, 4, 4, 24, cos,
                                                          ws)  # 24-wide heads: not whole tiles of 32 rows
    with pytest.raises(ValueError, match="qkv_gemv_decode_attention: x"):
        qkv_gemv_decode_attention(torch.cat([x, x]), w, b, dargs[1], cos, 4, 4, 32, dargs[6], *dargs[7:12],
                                  eps=1e-6, scale=1.0, workspace=ws)


if __name__ == "__main__" and is_worker(sys.argv):
    _interpreter_worker(sys.argv[2], sys.argv[3])


# ---------------------------------------------------------------- GPU

QWEN15 = (16, 16, 128, 128, False, 16, [(560, 1)], 2048, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("form", ["dot", "row"])
def test_one_grid_follows_the_two_kernels_gpu(monkeypatch, form):
    """bf16, Qwen1.5-MoE's shape (16 heads of 128, hidden 2048, a bias, 561 keys): against the two kernels (the
    projection within one bf16 rounding, the output within bf16 tolerance, the same cache slots written) and the
    torch reference; then captured in a CUDA graph with PDL and replayed on new inputs and positions, each replay
    against the two kernels run eagerly, the counters at zero after each."""
    from moeserve.ops.attention import qkv_gemv_triton as qg
    from moeserve.ops.attention.decode_triton import DecodeWorkspace, decode_attention_reference
    from moeserve.ops.basic import rope_cos_sin_cache
    monkeypatch.setattr(qg, "TILES", form)
    gen = torch.Generator().manual_seed(SEED)
    x, w, b, dargs = _case(QWEN15, gen, "cuda", torch.bfloat16, num_pages=1024, max_pos=4096)
    dargs[2] = rope_cos_sin_cache(128, 4096, 1e6, None, torch.device("cuda"))
    hq, hkv, d = 16, 16, 128
    scale = d ** -0.5
    ws = DecodeWorkspace(8, hq, hkv, d, torch.device("cuda"))
    tiles = {k: v for k, v in qg.tiles().items() if k != "row" or v}

    def check(o, qkv, cache, xs, positions, kv_pos, base_cache, what):
        apart_cache = base_cache.clone()
        a_qkv, a_out = _two_kernels(xs, w, b, [None, positions, dargs[2], hq, hkv, d, apart_cache, kv_pos,
                                                *dargs[8:]], scale, ws, tiles)
        torch.cuda.synchronize()
        assert (qkv.float() - a_qkv.float()).abs().max() <= 1.6e-2 * a_qkv.float().abs().max(), what
        err = (o.float() - a_out.float()).norm() / a_out.float().norm()
        assert err < BF16_REL, f"seed {SEED}, {form}, {what}: against the two kernels: relative error {err:.2e}"
        assert (cache.float() - apart_cache.float()).abs().max() < 1.6e-2, what
        assert not ws.counter.any() and not ws.rows_done.any(), f"{what}: counters not back at zero"
    cache = dargs[6].clone()
    qkv = torch.empty(1, w.shape[0], dtype=torch.bfloat16, device="cuda")
    o = qg.qkv_gemv_decode_attention(x, w, b, dargs[1], dargs[2], hq, hkv, d, cache, *dargs[7:12], eps=1e-6,
                                     scale=scale, workspace=ws, qkv=qkv)
    check(o, qkv, cache, x, dargs[1], dargs[7], dargs[6], "eager")
    ref_cache = dargs[6].clone()
    ref_qkv = (x.float() @ w.float().T + b.float()).bfloat16()
    ref = decode_attention_reference(ref_qkv, dargs[1], dargs[2], hq, hkv, d, ref_cache, *dargs[7:12], eps=1e-6,
                                     scale=scale)
    assert (o.float() - ref.float()).norm() / ref.float().norm() < BF16_REL

    gx, gpos, gkv = x.clone(), dargs[1].clone(), dargs[7].clone()
    gcache = dargs[6].clone()
    graph, go = capture_with_pdl(lambda: qg.qkv_gemv_decode_attention(
        gx, w, b, gpos, dargs[2], hq, hkv, d, gcache, gkv, *dargs[8:12], eps=1e-6, scale=scale, workspace=ws, qkv=qkv))
    for trial, p in enumerate([600, 17, 1]):
        gx.copy_(torch.randn(1, w.shape[1], generator=gen).bfloat16())
        gpos.fill_(p)
        gkv.fill_(p)
        gcache.copy_(dargs[6])
        graph.replay()
        check(go, qkv, gcache, gx, gpos, gkv, dargs[6], f"replay {trial} at position {p}")
