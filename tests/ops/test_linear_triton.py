"""Tests of the Triton GEMV behind the ``triton`` linear backend (steps of few tokens).

CPU: the kernels under Triton's interpreter (one subprocess) against a float64 ``x @ W^T + b``, on odd shapes
(N not a multiple of the tile, K not a multiple of BLOCK_K, 1 to 16 rows; one row runs the one-row kernel). GPU
(``-m gpu``): bf16 and fp16 on the Qwen1.5-MoE linears against float32, inside a CUDA graph, and the backend's
choice between the GEMV and cuBLAS. Inputs are fresh random each run; the seed is in failure messages
(``MOESERVE_TEST_SEED``).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from graph_capture import capture_with_pdl  # noqa: E402
from triton_interpreter import is_worker, patch_for_numpy, run_worker  # noqa: E402

SEED = int(os.environ.get("MOESERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
FP32_RTOL, FP32_ATOL = 1e-5, 1e-5
HALF_REL_TOL = 2e-2  # one bf16 rounding of a float32 sum (2**-8 per element), relative to the largest output

# name: (M, N, K, bias, dtype, config)
CPU_CASES = {
    "M1-bias": (1, 40, 96, True, torch.float32, {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}),
    "M3-oddK": (3, 33, 100, False, torch.float32, {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}),
    "M16-fp16": (16, 48, 128, True, torch.float16, {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}),
    "M0": (0, 16, 64, False, torch.float32, None),
    # one row: the one-row kernel (_gemv_row_kernel), with a bias, with K not a multiple of BLOCK_K, and with
    # its built-in tiles (gemv_row_config) of a weight of at most 4,096 rows: the whole K (2048) in one masked tile
    "row-M1-bias": (1, 40, 96, True, torch.float32, {"row": True, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4,
                                                     "num_stages": 1}),
    "row-M1-oddK": (1, 33, 100, False, torch.float16, {"row": True, "BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 2,
                                                       "num_stages": 3}),
    # the first weight tile loaded before the PDL wait ("preload"): two K tiles (the second masked, or both full),
    # and a K shorter than one tile (the loop after the first tile runs no iteration)
    "M3-oddK-preload": (3, 33, 100, False, torch.float32, {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4,
                                                           "num_stages": 2, "preload": True}),
    "M4-evenK-preload": (4, 32, 128, True, torch.float32, {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4,
                                                           "num_stages": 2, "preload": True}),
    "M2-shortK-preload": (2, 40, 48, True, torch.float16, {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4,
                                                           "num_stages": 2, "preload": True}),
    "row-M1-oddK-preload": (1, 33, 100, False, torch.float16, {"row": True, "BLOCK_N": 8, "BLOCK_K": 64,
                                                               "num_warps": 2, "num_stages": 3, "preload": True}),
    "row-M1-evenK-preload": (1, 24, 128, False, torch.float32, {"row": True, "BLOCK_N": 8, "BLOCK_K": 64,
                                                                "num_warps": 2, "num_stages": 3, "preload": True}),
    "row-M1-wholeK-preload": (1, 40, 96, True, torch.float32, {"row": True, "BLOCK_N": 16, "BLOCK_K": 128,
                                                               "num_warps": 4, "num_stages": 1, "preload": True}),
    "M1-builtin": (1, 48, 1024, False, torch.float32, None),
    # the built-in tiles (gemv_config) of a weight of at most 4,096 rows: BLOCK_K 512, 3 stages
    "M2-builtin-oddK": (2, 40, 1000, True, torch.float16, None),
}


# the LM head's GEMV with the argmax in its epilogue (gemv_argmax, gemv_config's tiles): (M, N, K, dtype, case)
# "ties": row 0's largest output's weight row copied to a row before it and one after it, in other programs;
# "negative": every output below zero; "zero": every output +0.0
ARGMAX_CASES = {"M1-ties": (1, 4500, 64, torch.float16, "ties"), "M3-ties": (3, 700, 96, torch.float16, "ties"),
                "M1-negative": (1, 300, 64, torch.float32, "negative"), "M2-zero": (2, 100, 32, torch.float32, "zero"),
                "M16": (16, 260, 40, torch.float16, "random")}  # (the interpreter has no bf16)


def make_argmax_case(m, n, k, dtype, kind, gen):
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    if kind == "ties":  # small integers over 8: every sum exact in float32 in any order, so copied rows tie exactly
        x = torch.randint(-2, 3, (m, k), generator=gen).float()
        w = torch.randint(-2, 3, (n, k), generator=gen) / 8
        top = int((x[0] @ w.T).argmax())
        # two copies a third of the rows apart: three programs (not top // 3, which for a top below three tiles of
        # rows fell in top's own program one seed in ten)
        low, high = (top + n // 3) % n, (top + 2 * n // 3) % n
        w[low], w[high] = w[top], w[top]
    elif kind == "negative":
        x, w = x.abs(), -w.abs()
    elif kind == "zero":
        x = torch.zeros(m, k)
    return x.to(dtype), w.to(dtype)


def _worker(in_path: str, out_path: str) -> None:
    patch_for_numpy()
    from moeserve.ops.linear_triton import BEST_EMPTY, GEMV_MAX_ROWS, gemv, gemv_argmax
    inputs = torch.load(in_path)
    out = {name: gemv(x, w, b, cfg) for name, (x, w, b, cfg) in inputs["gemv"].items()}
    best = torch.full((GEMV_MAX_ROWS,), BEST_EMPTY, dtype=torch.int64)
    for name, (x, w) in inputs["argmax"].items():  # each case launched twice on the same slots
        out[name] = (*gemv_argmax(x, w, best), gemv_argmax(x, w, best)[1], best.clone())
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    gen = torch.Generator().manual_seed(SEED)
    inputs = {}
    for name, (m, n, k, bias, dtype, cfg) in CPU_CASES.items():
        x = torch.randn(m, k, generator=gen).to(dtype)
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype) if bias else None
        inputs[name] = (x, w, b, cfg)
    argmax = {name: make_argmax_case(*spec, gen) for name, spec in ARGMAX_CASES.items()}
    outputs = run_worker(__file__, {"gemv": inputs, "argmax": argmax}, tmp_path_factory.mktemp("gemv"), SEED)
    return {**inputs, **argmax}, outputs


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_gemv_interpreter(interpreted, name):
    inputs, outputs = interpreted
    x, w, b, _ = inputs[name]
    y = outputs[name]
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == ref.shape and y.dtype == x.dtype
    if x.dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=FP32_RTOL, atol=FP32_ATOL, msg=lambda m: f"seed {SEED}: {m}")
    elif ref.numel():
        err = float((y.double() - ref).abs().max() / ref.abs().max())
        assert err < HALF_REL_TOL, f"seed {SEED}: max relative error {err:.3g}"


@pytest.mark.parametrize("name", list(ARGMAX_CASES))
def test_gemv_argmax_interpreter(interpreted, name):
    """``gemv_argmax``: the logits :func:`gemv` computes, and their argmax as torch's (the first of equal values),
    at a second launch on the same slots too, which it leaves empty."""
    from moeserve.ops.linear_triton import BEST_EMPTY, gemv_config
    inputs, outputs = interpreted
    x, w = inputs[name]
    y, tokens, again, best = outputs[name]
    ref = F.linear(x.double(), w.double())
    assert y.dtype == x.dtype and tokens.dtype == torch.int64 and tokens.shape == (x.shape[0],)
    assert float((y.double() - ref).abs().max()) <= HALF_REL_TOL * max(float(ref.abs().max()), 1e-6), f"seed {SEED}"
    assert torch.equal(tokens, y.argmax(dim=-1)) and torch.equal(again, tokens), f"seed {SEED}: {tokens} {again}"
    assert bool((best == BEST_EMPTY).all())
    kind = ARGMAX_CASES[name][4]
    block = gemv_config(w.shape[0], w.shape[1])["BLOCK_N"]
    if kind == "ties":  # row 0's largest value sits at three rows, in three programs; the first wins
        top = (y[0] == y[0].max()).nonzero().flatten().tolist()
        assert len(top) >= 3 and len({r // block for r in top}) >= 3 and tokens[0] == top[0]
    elif kind == "negative":
        assert bool((y < 0).all())
    elif kind == "zero":
        assert tokens.tolist() == [0] * x.shape[0]


def test_gemv_refuses_more_rows_than_one_tile():
    from moeserve.ops.linear_triton import GEMV_MAX_ROWS, gemv
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv(torch.zeros(GEMV_MAX_ROWS + 1, 8), torch.zeros(4, 8))


def test_one_row_tiles_refuse_more_rows():
    from moeserve.ops.linear_triton import gemv
    tiles = {"row": True, "BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}
    with pytest.raises(ValueError, match="one-row GEMV's tiles were given 2 rows"):
        gemv(torch.zeros(2, 64), torch.zeros(8, 64), config=tiles)


def test_backend_takes_only_small_half_precision_cuda_steps():
    """On the CPU (and for float32, FP8 or big steps) the backend is cuBLAS/F.linear, exactly."""
    from moeserve.ops.linear_triton import TritonLinear
    lin = TritonLinear(torch.device("cpu"), torch.float32, max_tokens=8)
    x, w, b = torch.randn(2, 16), torch.randn(8, 16), torch.randn(8)
    assert not lin.takes(x, w)
    bf = torch.bfloat16  # the shapes it would take on a GPU: the LM head too, not the router (64 rows)
    assert lin.takes_shape(1, 6144, bf, bf) and not lin.takes_shape(1, 64, bf, bf)
    assert lin.takes_shape(1, 151936, bf, bf) and not lin.takes_shape(9, 6144, bf, bf)
    assert torch.equal(lin.linear(x, w, b), F.linear(x, w, b))


def test_one_row_tiles_preload_their_weights_and_the_dot_tiles_do_not(monkeypatch):
    """The output projection's one-row tiles load their weights before the PDL wait (``ROW_PRELOAD``, measured
    faster); the QKV projection's and the LM head's :func:`_gemv_kernel` tiles do not (the QKV preload measured
    slower); ``ROW_PRELOAD = False`` gives the one-row tiles without it."""
    from moeserve.ops import linear_triton
    assert linear_triton.gemv_tiles(1, 2048, 2048) == {"row": True, "BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 4,
                                                        "num_stages": 3, "preload": True}
    for m, n in ((1, 6144), (1, 151936), (4, 2048)):
        assert "preload" not in linear_triton.gemv_tiles(m, n, 2048), (m, n)
    monkeypatch.setattr(linear_triton, "ROW_PRELOAD", False)
    assert "preload" not in linear_triton.gemv_tiles(1, 2048, 2048)
    # the A/B switch: the QKV projection's tiles, not the LM head's
    monkeypatch.setattr(linear_triton, "GEMV_PRELOAD", True)
    assert linear_triton.gemv_tiles(1, 6144, 2048).get("preload") and "preload" not in linear_triton.gemv_tiles(
        1, 151936, 2048)


def test_the_lm_head_goes_through_the_linear_backend():
    """``compute_logits`` hands the LM head to the linear backend (the GEMV for one-token steps on a GPU), and
    its logits are ``F.linear``'s in float32."""
    from hf_models import plan_model
    from moeserve.config import make_config
    from moeserve.ops.linear import TorchLinear
    from moeserve.plan import resolve_plan
    plan = resolve_plan(make_config(model="tiny", device="cpu", dtype="float32"))
    seen = []

    class Spy(TorchLinear):
        def linear(self, x, weight, bias=None):
            seen.append(tuple(weight.shape))
            return super().linear(x, weight, bias)

    model = plan_model(plan, linear=Spy(plan.device, plan.dtype))
    torch.nn.init.normal_(model.lm_head)
    hidden = torch.randn(3, plan.arch.hidden_size)
    logits = model.compute_logits(hidden)
    assert seen == [(plan.arch.vocab_size, plan.arch.hidden_size)]
    assert logits.dtype == torch.float32 and torch.equal(logits, F.linear(hidden, model.lm_head).float())


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Qwen1.5-MoE-A2.7B's dense linears: (N, K, bias)
QWEN15_LINEARS = {"qkv": (6144, 2048, True), "o": (2048, 2048, False), "shared_gate_up": (11264, 2048, False),
                  "shared_down": (2048, 5632, False), "router": (64, 2048, False), "lm_head": (151936, 2048, False)}


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(QWEN15_LINEARS))
def test_gemv_gpu_against_float32(name, dtype):
    from moeserve.ops.linear_triton import gemv
    n, k, bias = QWEN15_LINEARS[name]
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen, device="cuda").to(dtype) if bias else None
    for m in (1, 2, 5, 8, 16):
        x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = gemv(x, w, b)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        assert y.dtype == dtype and err < HALF_REL_TOL, f"seed {SEED}: {name} M={m}: max relative error {err:.3g}"


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 3])
def test_lm_head_argmax_in_a_cuda_graph_matches_torch(m):
    """The backend's ``linear_argmax`` on the Qwen1.5-MoE LM head (151,936 x 2048) after a PDL producer (the Triton
    add + RMSNorm), captured once and replayed on new inputs: the logits are :func:`gemv`'s bit for bit and the
    tokens torch's argmax of them, also when the largest logit is tied across programs (the first row wins)."""
    from moeserve.ops.linear_triton import TritonLinear, gemv
    from moeserve.ops.norm_triton import add_rmsnorm
    n, k, _ = QWEN15_LINEARS["lm_head"]
    lin = TritonLinear(torch.device("cuda"), torch.bfloat16, max_tokens=4)
    gen = torch.Generator(device="cuda").manual_seed(SEED + m)
    w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).bfloat16()
    gamma = torch.rand(k, generator=gen, device="cuda").bfloat16() + 0.5
    x, res = (torch.randn(m, k, generator=gen, device="cuda").bfloat16() for _ in range(2))
    graph, (logits, tokens) = capture_with_pdl(  # (loaded outside the graph on copies of the inputs)
        lambda: lin.linear_argmax(add_rmsnorm(x, res, gamma, 1e-6)[0], w), m,
        warm=lambda: lin.linear_argmax(add_rmsnorm(x.clone(), res.clone(), gamma, 1e-6)[0], w))
    for replay in range(4):
        x0, r0 = (torch.randn(m, k, generator=gen, device="cuda").bfloat16() for _ in range(2))
        normed, _ = add_rmsnorm(x0.clone(), r0.clone(), gamma, 1e-6)
        if replay == 3:  # row 0's largest logit at two more rows, one before it, one after
            top = int(gemv(normed, w)[0].float().argmax())
            low, high = top // 2, (top + n) // 2
            w[low], w[high] = w[top], w[top]
        x.copy_(x0)
        res.copy_(r0)
        graph.replay()
        torch.cuda.synchronize()
        expect = gemv(normed, w)
        torch.testing.assert_close(logits, expect, rtol=0, atol=0)
        assert torch.equal(tokens, expect.argmax(dim=-1)), f"seed {SEED}, replay {replay}: {tokens} {expect.argmax(-1)}"
        if replay == 3:  # identical weight rows: identical sums (each output's K order is the same)
            assert expect[0, low] == expect[0, top] == expect[0, high] and tokens[0] == min(low, top), f"seed {SEED}"
    assert bool((lin.argmax_slots == -(1 << 63)).all())


@gpu
@needs_cuda
@pytest.mark.parametrize("name, m", [("qkv", 1), ("qkv", 4), ("o", 1)])
def test_preloading_gemv_after_a_pdl_producer_in_a_cuda_graph(name, m):
    """The GEMV with its first weight tile loaded before its PDL wait (``"preload"``; the one-row kernel for the
    output projection's one row, :func:`_gemv_kernel` otherwise) right after a kernel that writes its input and
    lets it start early (the Triton add + RMSNorm), in a CUDA graph replayed on new inputs: bit for bit the same
    GEMV without the preload run eagerly on the norm's output, and float32's result within a rounding."""
    from moeserve.ops.linear_triton import gemv, gemv_tiles
    from moeserve.ops.norm_triton import add_rmsnorm
    n, k, bias = QWEN15_LINEARS[name]
    tiles = {**gemv_tiles(m, n, k), "preload": True}
    assert tiles.get("row", False) == (name == "o" and m == 1)
    gen = torch.Generator(device="cuda").manual_seed(SEED + m)
    w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=gen, device="cuda").bfloat16() if bias else None
    gamma = torch.rand(k, generator=gen, device="cuda").bfloat16() + 0.5
    x, res = (torch.randn(m, k, generator=gen, device="cuda").bfloat16() for _ in range(2))
    graph, out = capture_with_pdl(  # (loaded outside the graph on copies of the inputs)
        lambda: gemv(add_rmsnorm(x, res, gamma, 1e-6)[0], w, b, tiles), m,
        warm=lambda: gemv(add_rmsnorm(x.clone(), res.clone(), gamma, 1e-6)[0], w, b, tiles))
    for _ in range(3):
        x0, r0 = (torch.randn(m, k, generator=gen, device="cuda").bfloat16() for _ in range(2))
        x.copy_(x0)
        res.copy_(r0)
        graph.replay()
        normed, _ = add_rmsnorm(x0.clone(), r0.clone(), gamma, 1e-6)
        torch.testing.assert_close(x, normed, rtol=0, atol=0)
        plain = {key: v for key, v in tiles.items() if key != "preload"}
        torch.testing.assert_close(out, gemv(normed, w, b, plain), rtol=0, atol=0)
        ref = F.linear(normed.float(), w.float(), None if b is None else b.float())
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        assert err < HALF_REL_TOL, f"seed {SEED}: {name} M={m}: max relative error {err:.3g}"


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4])
def test_gemv_backend_in_a_cuda_graph(m):
    """The backend inside a captured graph replays on new inputs as it runs eagerly (bitwise), and a step
    over ``max_tokens`` rows goes to cuBLAS."""
    from moeserve.ops.linear_triton import TritonLinear
    lin = TritonLinear(torch.device("cuda"), torch.bfloat16, max_tokens=4)
    gen = torch.Generator(device="cuda").manual_seed(SEED + m)
    w = (torch.randn(6144, 2048, generator=gen, device="cuda") / 2048 ** 0.5).bfloat16()
    b = torch.randn(6144, generator=gen, device="cuda").bfloat16()
    x = torch.randn(m, 2048, generator=gen, device="cuda").bfloat16()
    assert lin.takes(x, w) and not lin.takes(torch.randn(5, 2048, device="cuda").bfloat16(), w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lin.linear(x, w, b)  # compile outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            out = lin.linear(x, w, b)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        x.copy_(torch.randn(m, 2048, generator=gen, device="cuda").bfloat16())
        graph.replay()
        torch.testing.assert_close(out, lin.linear(x, w, b), rtol=0, atol=0)
        ref = F.linear(x.float(), w.float(), b.float())
        assert float((out.float() - ref).abs().max() / ref.abs().max()) < HALF_REL_TOL


if __name__ == "__main__" and is_worker(sys.argv):
    _worker(sys.argv[2], sys.argv[3])
