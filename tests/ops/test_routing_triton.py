"""The Triton top-k routing kernel (softmax and Llama-4 routing) against the torch reference.

CPU: the kernel runs under Triton's interpreter in one subprocess. GPU (``-m gpu``): the real kernel at the
routing shapes of Qwen1.5-MoE, Qwen3-MoE, Mixtral and Llama 4, on logits that are a column slice of a wider
tensor (the router GEMM merged with the shared expert's gate), and inside a CUDA graph.

Checks, on fresh random logits (the seed is printed on failure; ``MOESERVE_TEST_SEED`` replays one):
- the chosen experts equal the reference's wherever the k-th and (k+1)-th logits differ by more than
  ``TIE_GAP`` (closer ones may be ordered either way, by both implementations);
- everywhere, each weight is the reference formula evaluated at the expert the kernel chose, to
  ``RTOL``/``ATOL``, and the chosen experts are distinct.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from moeserve.ops.moe.routing import RoutingConfig, llama4_topk, softmax_topk  # noqa: E402
from triton_interpreter import is_worker, patch_for_numpy, run_worker  # noqa: E402

SEED = int(os.environ.get("MOESERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
RTOL, ATOL = 1e-5, 1e-7
TIE_GAP = 1e-3

# name: (T, E, k, method, renormalize, dtype, extra columns beside the logits)
CPU_CASES = {
    "qwen15-T5": (5, 60, 4, "softmax", False, torch.float32, 1),
    "qwen3-T3-renorm": (3, 128, 8, "softmax", True, torch.float32, 0),
    "mixtral-T9-bf16": (9, 8, 2, "softmax", True, torch.bfloat16, 0),
    "llama4-T4": (4, 16, 1, "llama4", False, torch.float32, 0),
    "k-equals-E": (2, 4, 4, "softmax", True, torch.float32, 0),
    "T0": (0, 60, 4, "softmax", False, torch.float32, 1),
}


def reference(logits: torch.Tensor, method: str, k: int, renormalize: bool):
    if method == "softmax":
        return softmax_topk(logits, k, renormalize)
    return llama4_topk(logits, k)


def weights_at(logits: torch.Tensor, ids: torch.Tensor, method: str, renormalize: bool) -> torch.Tensor:
    """The reference formula for the weights of the experts ``ids`` (float64)."""
    x = logits.double()
    if method == "llama4":
        return torch.sigmoid(x.gather(1, ids.long()))
    if renormalize:
        return torch.softmax(x.gather(1, ids.long()), dim=-1)
    return torch.softmax(x, dim=-1).gather(1, ids.long())


def check(logits, weights, ids, method, k, renormalize):
    logits, weights, ids = logits.cpu(), weights.cpu(), ids.cpu()
    t = logits.shape[0]
    assert weights.shape == ids.shape == (t, k) and weights.dtype == torch.float32 and ids.dtype == torch.int32
    if t == 0:
        return
    assert bool(((ids >= 0) & (ids < logits.shape[1])).all()), f"seed {SEED}: expert id out of range"
    assert bool((ids.sort(-1).values.diff(dim=-1) > 0).all()) if k > 1 else True, f"seed {SEED}: repeated expert"
    torch.testing.assert_close(weights.double(), weights_at(logits, ids, method, renormalize), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"seed {SEED}: {m}")
    w_ref, ids_ref = reference(logits.float(), method, k, renormalize)
    top = logits.float().sort(-1, descending=True).values
    clear = (top[:, k - 1] - top[:, k] > TIE_GAP) if k < logits.shape[1] else torch.ones(t, dtype=torch.bool)
    # a guard against a vacuous check; one or a few rows may tie by chance (bf16 has 8 bits of mantissa)
    assert t < 16 or clear.float().mean() > 0.5, "the random logits should mostly have a clear k-th expert"
    assert torch.equal(ids.sort(-1).values[clear], ids_ref.sort(-1).values[clear]), f"seed {SEED}: other experts"
    if k > 1:  # the kernel orders its choice by logit, like torch.topk
        first = clear & (top[:, 0] - top[:, 1] > TIE_GAP)
        assert torch.equal(ids[first, 0], ids_ref[first, 0]), f"seed {SEED}: best expert not first"


def make_full(T, E, dtype, extra, gen, device="cpu"):
    """``[T, E + extra]`` random logits; ``[:, :E]`` of it is strided like the merged router GEMM's output."""
    return (torch.randn(T, E + extra, generator=gen, device=device) * 2).to(dtype)

# a fused shared expert's columns: name: (T, E, k, method, renormalize, pieces, gated, extra columns)
SHARED_CASES = {
    "qwen15-gated": (6, 60, 4, "softmax", False, 4, True, 4),
    "ungated-renorm": (3, 16, 2, "softmax", True, 3, False, 0),
}


# the router's GEMM as partial sums (router_partials) and the routing kernel that adds them:
# name: (T, K, E, router rows (E, the gate, zero padding), k, method, renormalize, fused shared pieces, gated)
SPLIT_CASES = {
    "qwen15-gated": (5, 256, 60, 64, 4, "softmax", False, 0, True),
    "qwen15-fused-shared": (2, 256, 60, 64, 4, "softmax", False, 4, True),
    "qwen3-renorm-ragged-k": (3, 200, 128, 128, 8, "softmax", True, 0, False),
    "llama4-T17": (17, 128, 16, 16, 1, "llama4", False, 0, False),
}
SPLIT_RTOL, SPLIT_ATOL = 2 ** -7, 1e-3  # one bf16 rounding step of the logits (the sum's order differs)
# the post-attention residual add and norm folded into the partial sums (router_fuse_norm):
# name: (T, K, E, router rows, k, method, renormalize, gated, dtype)
NORM_SPLIT_CASES = {
    "qwen15-gated-T1-fp16": (1, 256, 60, 64, 4, "softmax", False, True, torch.float16),
    "qwen3-renorm-T5-ragged-K-bf16": (5, 200, 128, 128, 8, "softmax", True, False, torch.bfloat16),
}
NORM_EPS = 1e-6


def make_norm_inputs(T, K, gen, dtype, device="cpu"):
    """The attention block's output, the residual stream (larger), the norm's weight."""
    x = torch.randn(T, K, generator=gen, device=device).to(dtype)
    res = (torch.randn(T, K, generator=gen, device=device) * 4).to(dtype)
    nw = (1 + 0.5 * torch.randn(K, generator=gen, device=device)).to(dtype)
    return x, res, nw


def check_norm_split(x, res, nw, w, out, E, k, method, renorm, gated):
    """``h``, the new residual (each within a rounding of their dtype of the float64 formula; the input residual
    untouched), and the routing of the router's GEMM of that ``h``."""
    h, new_res, routed = out
    r = x.double().cpu() + res.double().cpu()
    want_h = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + NORM_EPS) * nw.double().cpu()
    for got, want in ((new_res, r), (h, want_h)):
        assert got.dtype == x.dtype and got.shape == x.shape
        err = float((got.double().cpu() - want).abs().max() / want.abs().max())
        assert err < 1e-2, f"seed {SEED}: max error {err:.3g} of the largest value"
    check_split(h, w, routed, E, k, method, renorm, 0, gated)


def make_router(T, K, E, rows, gated, gen, device="cpu", dtype=torch.bfloat16):
    """Tokens and router rows: ``E`` experts, the shared expert's gate (``gated``), zero rows up to ``rows``.
    (The CPU cases are float16: Triton 3.6's interpreter computes bfloat16 ``tl.dot`` wrongly.)"""
    x = torch.randn(T, K, generator=gen, device=device).to(dtype)
    w = torch.randn(rows, K, generator=gen, device=device) / K ** 0.5 * 4
    w[E + (1 if gated else 0):] = 0
    return x, w.to(dtype)


def run_split(x, w, E, k, method, renorm, shared, gated):
    from moeserve.ops.moe.routing_triton import router_partials, topk_route_partials
    return topk_route_partials(router_partials(x, w), E, method, k, renorm, shared=shared, gated=gated)


def check_split(x, w, out, E, k, method, renorm, shared, gated):
    """The logits as ``F.linear`` writes them (to a rounding step of their dtype), and the routing of those
    logits."""
    weights, ids, logits = (o.cpu() for o in out)
    want = torch.nn.functional.linear(x.float(), w.float()).to(w.dtype).cpu()
    assert logits.shape == want.shape and logits.dtype == w.dtype
    torch.testing.assert_close(logits.float(), want.float(), rtol=SPLIT_RTOL, atol=SPLIT_ATOL,
                               msg=lambda m: f"seed {SEED}: {m}")
    check(logits[:, :E], weights[:, :k].contiguous(), ids[:, :k].contiguous(), method, k, renorm)
    if shared:
        t = logits.shape[0]
        assert torch.equal(ids[:, k:], torch.arange(E, E + shared, dtype=ids.dtype).expand(t, shared))
        gate = torch.sigmoid(logits[:, E:E + 1].float()) if gated else torch.ones(t, 1)
        torch.testing.assert_close(weights[:, k:], gate.expand(t, shared), rtol=RTOL, atol=ATOL)


def _interpreter_worker(in_path: str, out_path: str) -> None:
    patch_for_numpy()
    from moeserve.ops.moe.routing_triton import topk_route
    inputs = torch.load(in_path)
    out = {}
    for name, (x, w, E, k, method, renorm, shared, gated) in inputs.pop("_split").items():
        out["split-" + name] = run_split(x, w, E, k, method, renorm, shared, gated)
    from moeserve.ops.moe.routing_triton import add_norm_router_partials, topk_route_partials
    for name, (x, res, nw, w, E, k, method, renorm, gated) in inputs.pop("_norm_split").items():
        h, new_res, p = add_norm_router_partials(x, res, nw, NORM_EPS, w)
        out["norm-split-" + name] = (h, new_res, topk_route_partials(p, E, method, k, renorm, gated=gated), res)
    for name, (full, e, k, method, renorm, shared, gated) in inputs.pop("_shared").items():
        out["shared-" + name] = topk_route(full[:, :e], method, k, renorm, shared=shared, gated=gated)
    for name, (full, e, k, method, renorm) in inputs.items():
        out[name] = topk_route(full[:, :e], method, k, renorm)
    out["ties"] = topk_route(torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0]]), "softmax", 2, False)
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    gen = torch.Generator().manual_seed(SEED)
    inputs = {}
    for name, (T, E, k, method, renorm, dtype, extra) in CPU_CASES.items():
        inputs[name] = (make_full(T, E, dtype, extra, gen), E, k, method, renorm)
    inputs["_shared"] = {name: (make_full(T, E, torch.float32, extra, gen), E, k, method, renorm, shared, gated)
                         for name, (T, E, k, method, renorm, shared, gated, extra) in SHARED_CASES.items()}
    inputs["_split"] = {name: (*make_router(T, K, E, rows, gated, gen, dtype=torch.float16), E, k, method, renorm,
                               shared, gated)
                        for name, (T, K, E, rows, k, method, renorm, shared, gated) in SPLIT_CASES.items()}
    inputs["_norm_split"] = {}
    for name, (T, K, E, rows, k, method, renorm, gated, dtype) in NORM_SPLIT_CASES.items():
        x, res, nw = make_norm_inputs(T, K, gen, dtype)
        w = make_router(T, K, E, rows, gated, gen, dtype=dtype)[1]
        inputs["_norm_split"][name] = (x, res, nw, w, E, k, method, renorm, gated)
    return inputs, run_worker(__file__, inputs, tmp_path_factory.mktemp("route"), SEED, timeout=300)


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_topk_route_interpreter(interpreted, name):
    inputs, outputs = interpreted
    full, e, k, method, renorm = inputs[name]
    w, ids = outputs[name]
    check(full[:, :e], w, ids, method, k, renorm)


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_router_gemm_as_partial_sums_routes_like_the_gemm_interpreter(interpreted, name):
    inputs, outputs = interpreted
    x, w, E, k, method, renorm, shared, gated = inputs["_split"][name]
    check_split(x, w, outputs["split-" + name], E, k, method, renorm, shared, gated)


@pytest.mark.parametrize("name", list(NORM_SPLIT_CASES))
def test_post_attention_norm_in_the_router_partial_sums_interpreter(interpreted, name):
    """``router_fuse_norm``: one kernel adds the residual, normalises, and writes the router's partial sums of
    the normalised row; against the float64 formula and ``F.linear`` of the ``h`` it wrote."""
    inputs, outputs = interpreted
    x, res, nw, w, E, k, method, renorm, gated = inputs["_norm_split"][name]
    h, new_res, routed, res_after = outputs["norm-split-" + name]
    assert torch.equal(res_after, res), "the input residual must not change (other programs still read it)"
    check_norm_split(x, res, nw, w, (h, new_res, routed), E, k, method, renorm, gated)


def test_router_partials_refuse_what_they_do_not_hold():
    from moeserve.ops.moe.routing_config import RouterPartials
    from moeserve.ops.moe.routing_triton import TritonTopkRouter, router_partials, topk_route_partials
    with pytest.raises(ValueError, match="at most 64 tokens and 256 rows"):
        router_partials(torch.zeros(65, 32), torch.zeros(8, 32))
    with pytest.raises(ValueError, match="60 router rows for 60 experts and the shared expert's gate"):
        topk_route_partials(RouterPartials(torch.zeros(2, 1, 64), 60, torch.bfloat16), 60, "softmax", 4, gated=True)
    r = TritonTopkRouter(RoutingConfig("softmax", 4), split_max_tokens=8)
    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    assert r.takes_gemm(1, w) and r.takes_gemm(8, w) and not r.takes_gemm(9, w) and not r.takes_gemm(0, w)
    assert not r.takes_gemm(1, w.float()) and not r.takes_gemm(1, torch.zeros(300, 32, dtype=torch.bfloat16))
    assert not TritonTopkRouter(RoutingConfig("softmax", 4)).takes_gemm(1, w)


@pytest.mark.parametrize("name", list(SHARED_CASES))
def test_topk_route_appends_the_fused_shared_expert(interpreted, name):
    """The routed columns as without sharing; then ids E.. and the sigmoid of the gate logit (column E of the
    same rows) or 1."""
    inputs, outputs = interpreted
    full, e, k, method, renorm, shared, gated = inputs["_shared"][name]
    w, ids = outputs["shared-" + name]
    t = full.shape[0]
    assert w.shape == ids.shape == (t, k + shared)
    check(full[:, :e], w[:, :k].contiguous(), ids[:, :k].contiguous(), method, k, renorm)
    assert torch.equal(ids[:, k:], torch.arange(e, e + shared, dtype=ids.dtype).expand(t, shared))
    want = torch.sigmoid(full[:, e:e + 1].float()) if gated else torch.ones(t, 1)
    torch.testing.assert_close(w[:, k:], want.expand(t, shared), rtol=RTOL, atol=ATOL)


def test_equal_logits_choose_the_lowest_index_first(interpreted):
    w, ids = interpreted[1]["ties"]
    assert ids.tolist() == [[1, 2]]
    p = torch.softmax(torch.tensor([1.0, 3.0, 3.0, 0.5, 3.0]), 0)
    torch.testing.assert_close(w, p[[1, 2]][None], rtol=RTOL, atol=ATOL)


def test_unsupported_routing_is_named():
    from moeserve.ops.moe.routing_triton import topk_route, unsupported
    assert unsupported("deepseek_v3", 64, 4) == "routing is deepseek_v3"
    assert "top_k 9 is outside 1..8" in unsupported("softmax", 8, 9)
    assert "max 4096" in unsupported("softmax", 8192, 2)
    with pytest.raises(ValueError, match="Triton routing: top_k 0"):
        topk_route(torch.zeros(1, 8), "softmax", 0)


def test_gpu_router_needs_a_gpu_for_softmax_routing():
    from moeserve.ops.moe.routing import gpu_router
    router, name, why = gpu_router(RoutingConfig("softmax", 2, True), 8, torch.device("cpu"))
    assert router is None and name == "torch" and why == "needs a CUDA GPU"


def test_routing_backend_auto_is_torch_on_cpu_and_fused_is_refused_there():
    from moeserve import LLM
    from moeserve.backends import BackendUnavailable
    llm = LLM(model="tiny", device="cpu", max_model_len=64, max_num_seqs=2)
    assert llm.engine.runner.backend_names["routing"] == "torch"
    assert all(b.routing_impl == "torch" for b in llm.engine.runner.model.moe_blocks())
    with pytest.raises(BackendUnavailable, match=r"backends\.routing: 'fused' is not available: needs a CUDA GPU"):
        LLM(model="tiny", device="cpu", max_model_len=64, max_num_seqs=2, backends={"routing": "fused"})


def test_shared_expert_gate_is_a_row_of_the_padded_router_weight(tmp_path):
    """Qwen2-MoE: the router GEMM also gives the shared expert's gate logit (row E, checkpoint value), the
    weight is padded to a multiple of 8 rows, and what the padding holds never reaches the output."""
    from hf_models import make_checkpoint
    from moeserve import LLM
    hf = make_checkpoint("qwen2_moe", tmp_path)
    block = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=64,
                max_num_seqs=2).engine.runner.model.layers[0].mlp
    hf_block = hf.model.layers[0].mlp
    e = block.num_experts
    w = block.gate.weight
    assert block.shared_gate_in_router and block.shared_expert_gate is None
    assert w.shape[0] % 8 == 0 and e + 1 <= w.shape[0] < e + 9
    assert torch.equal(w[:e], hf_block.gate.weight) and torch.equal(w[e:e + 1], hf_block.shared_expert_gate.weight)
    x = torch.randn(7, w.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = block(x)
        w[e + 1:] = float("nan")
        assert torch.equal(block(x), out)


def test_step_profile_sorts_routing_kernels_apart_from_sampling():
    from moeserve.bench.step_profile import family
    for name in ("_topk_route_kernel", "_router_partial_kernel", "_topk_route_partials_kernel",
                 "void at::native::sbtopk::gatherTopK<float>",
                 "void at::native::bitonicSortKVInPlace<-2>", "void at::native::softmax_warp_forward<float>"):
        assert family(name) == "routing", name
    for name in ("TopKTopPSamplingFromProbKernel", "void at::native::reduce_kernel<ArgMaxOps<float>>"):
        assert family(name) == "sampling", name
    assert family("_moe_align_kernel") == "moe"


# ---------------------------------------------------------------- GPU

GPU_SHAPES = {  # name: (E, k, method, renormalize)
    "qwen1.5-moe": (60, 4, "softmax", False),
    "qwen3-moe": (128, 8, "softmax", True),
    "mixtral": (8, 2, "softmax", True),
    "llama4-scout": (16, 1, "llama4", False),
    "llama4-maverick": (128, 1, "llama4", False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 33, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_topk_route_matches_torch_on_the_gpu(shape, dtype, T):
    from moeserve.ops.moe.routing import gpu_router
    E, k, method, renorm = GPU_SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(SEED + T)
    logits = make_full(T, E, dtype, 1, gen, "cuda")[:, :E]
    router, name, why = gpu_router(RoutingConfig(method, k, renorm), E, torch.device("cuda"))
    assert name == "triton_topk" and why is None
    w, ids = router(logits, None)
    check(logits, w, ids, method, k, renorm)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 16, 33, 64])
@pytest.mark.parametrize("shape", ["qwen1.5-moe", "qwen3-moe", "llama4-maverick"])
def test_router_gemm_as_partial_sums_on_the_gpu(shape, T):
    """At the models' hidden sizes, against ``F.linear`` (cuBLAS) and the routing of its logits."""
    E, k, method, renorm = GPU_SHAPES[shape]
    K, gated = {"qwen1.5-moe": (2048, True), "qwen3-moe": (2048, False), "llama4-maverick": (5120, False)}[shape]
    rows = -(-(E + gated) // 8) * 8
    gen = torch.Generator(device="cuda").manual_seed(SEED + T)
    x, w = make_router(T, K, E, rows, gated, gen, "cuda")
    check_split(x, w, run_split(x, w, E, k, method, renorm, 0, gated), E, k, method, renorm, 0, gated)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 16])
def test_post_attention_norm_in_the_router_partial_sums_on_the_gpu(T):
    """``router_fuse_norm`` at Qwen1.5's shape (bfloat16, the shared expert's gate a router row), launched with
    PDL: the new residual bit for bit FlashInfer's ``fused_add_rmsnorm``'s (the same float32 sum, rounded once),
    ``h`` within 1e-2 of its largest value of FlashInfer's (the sum of squares in another order), and the routing
    of the router's GEMM of that ``h``."""
    import flashinfer.norm

    from moeserve.ops import pdl
    from moeserve.ops.moe.routing_triton import add_norm_router_partials, topk_route_partials
    gen = torch.Generator(device="cuda").manual_seed(SEED + 100 + T)
    x, res, nw = make_norm_inputs(T, 2048, gen, torch.bfloat16, "cuda")
    w = make_router(T, 2048, 60, 64, True, gen, "cuda")[1]
    with pdl.enabled_as(64):
        h, new_res, p = add_norm_router_partials(x, res, nw, NORM_EPS, w)
        routed = topk_route_partials(p, 60, "softmax", 4, False, gated=True)
    fi_h, fi_res = x.clone(), res.clone()
    flashinfer.norm.fused_add_rmsnorm(fi_h, fi_res, nw, NORM_EPS)
    torch.cuda.synchronize()
    torch.testing.assert_close(new_res, fi_res, rtol=0, atol=0)
    err = float((h.float() - fi_h.float()).abs().max() / fi_h.float().abs().max())
    assert err < 1e-2, f"seed {SEED}: max error {err:.3g} of the largest value"
    check_norm_split(x, res, nw, w, (h, new_res, routed), 60, 4, "softmax", False, True)


@pytest.mark.gpu
def test_router_gemm_as_partial_sums_in_a_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    x, w = make_router(4, 2048, 60, 64, True, gen, "cuda")
    run_split(x, w, 60, 4, "softmax", False, 0, True)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run_split(x, w, 60, 4, "softmax", False, 0, True)
    x.copy_(make_router(4, 2048, 60, 64, True, gen, "cuda")[0])
    g.replay()
    torch.cuda.synchronize()
    check_split(x, w, out, 60, 4, "softmax", False, 0, True)


@pytest.mark.gpu
def test_topk_route_in_a_cuda_graph():
    from moeserve.ops.moe.routing_triton import topk_route
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    full = make_full(8, 60, torch.bfloat16, 1, gen, "cuda")
    logits = full[:, :60]
    topk_route(logits, "softmax", 4)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w, ids = topk_route(logits, "softmax", 4)
    full.copy_(make_full(8, 60, torch.bfloat16, 1, gen, "cuda"))
    g.replay()
    torch.cuda.synchronize()
    check(logits, w, ids, "softmax", 4, False)


@pytest.mark.gpu
def test_fused_routing_named_explicitly_refuses_a_layer_it_cannot_route():
    import types
    from moeserve.ops.moe.routing import FusedRouting
    from moeserve.backends import BackendUnavailable
    layer = types.SimpleNamespace(routing=RoutingConfig("deepseek_v3", 8, False), num_experts=64)
    with pytest.raises(BackendUnavailable, match=r"backends\.routing: 'fused' cannot run this model's deepseek_v3 "
                                                  r"routing \(64 experts, top-8\): .*always renormalises"):
        FusedRouting(torch.device("cuda"), explicit=True).prepare(layer)
    FusedRouting(torch.device("cuda"), explicit=False).prepare(layer)  # auto: torch routing for this layer
    assert layer.router is None and layer.routing_impl == "torch"
    ok = types.SimpleNamespace(routing=RoutingConfig("softmax", 4), num_experts=60)
    FusedRouting(torch.device("cuda"), explicit=True).prepare(ok)
    assert ok.routing_impl == "triton_topk"


if __name__ == "__main__" and is_worker(sys.argv):
    _interpreter_worker(sys.argv[2], sys.argv[3])
