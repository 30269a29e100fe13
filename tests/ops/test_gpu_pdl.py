"""Programmatic dependent launch (``moeserve.ops.pdl``) on the GPU: a decoder layer's chain of moeserve's Triton
kernels (GEMV, the one-kernel decode attention or QKV norm/rope/append, router partial sums, routing, expert
alignment, fused MoE, combine) back to back with cuBLAS and torch kernels and a side stream, captured in a CUDA
graph with PDL on and with PDL off, and replayed with fresh inputs: every output is bit-identical between the two
(a kernel that read its input before the kernel writing it had finished would read the previous replay's values),
and the MoE output matches the float32 torch formula."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from moe_cases import reference_moe  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEED = int(os.environ.get("MOESERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
H, HEADS, D, E, I, K, PAGE = 2048, 16, 128, 60, 1408, 4, 16  # Qwen1.5-MoE's layer
BF16_REL_FRO = 2e-2


def _layer(gen):
    from moeserve.ops.basic import rope_cos_sin_cache
    from moeserve.ops.moe.triton_kernels import interleave_gate_up

    def w(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda") / shape[-1] ** 0.5).bfloat16()
    router = w(64, H)  # 60 experts, the shared expert's gate (row 60), zero padding
    router[E + 1:] = 0
    w13 = w(E, 2 * I, H)
    return {"wqkv": w(3 * H, H), "bqkv": (torch.randn(3 * H, generator=gen, device="cuda") * 0.1).bfloat16(),
            "wo": w(H, H), "router": router, "shared": w(H, H), "w13_ref": w13, "w13": interleave_gate_up(w13),
            "w2": w(E, H, I), "cos_sin": rope_cos_sin_cache(D, 4096, 1e6, None, torch.device("cuda"))}


def _kv_metadata(t, gen):
    """One decode token per request, each after 0..39 cached tokens on pages of its own."""
    cached = torch.randint(0, 40, (t,), generator=gen).tolist()
    indptr, indices = [0], []
    for c in cached:
        indices += range(len(indices), len(indices) + c // PAGE + 1)
        indptr.append(len(indices))
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    return {"pos": i32(cached), "batch": i32(list(range(t))), "indices": i32(indices), "indptr": i32(indptr),
            "pages": len(indices)}


def _step(x, cache, m, lw, side, ws):
    """A decoder layer of moeserve's kernels at ``x [T, H]``: the outputs it leaves, by name. Steps the decode
    workspace ``ws`` serves run the one-kernel decode attention (which loads its first block of cached keys before
    its PDL wait), as the engine's decode steps do; larger ones the QKV kernel, whose q stands in for attention."""
    from moeserve.ops.attention.decode_triton import qkv_decode_attention
    from moeserve.ops.attention.qkv_triton import qkv_rope_append
    from moeserve.ops.linear_triton import GEMV_MAX_ROWS, gemv
    from moeserve.ops.moe.combine import SharedExpertOutput
    from moeserve.ops.moe.routing_triton import ROUTER_MAX_TOKENS, router_partials, topk_route, topk_route_partials
    from moeserve.ops.moe.triton_kernels import fused_moe
    t = x.shape[0]
    lin = gemv if t <= GEMV_MAX_ROWS else F.linear  # Triton GEMV, else cuBLAS
    qkv = lin(x, lw["wqkv"], lw["bqkv"])
    if ws.serves(t):
        q = qkv_decode_attention(qkv, m["pos"], lw["cos_sin"], HEADS, HEADS, D, cache, m["pos"], m["indices"],
                                 m["indptr"], None, None, 1e-6, D ** -0.5, ws)
    else:
        q = qkv_rope_append(qkv, m["pos"], lw["cos_sin"], HEADS, HEADS, D, cache, m["batch"], m["pos"], m["indices"],
                            m["indptr"], None, None, eps=1e-6)
    h = lin(q.view(t, -1), lw["wo"]) + x  # (the attention's output, or q) a torch kernel between two of ours
    if t <= ROUTER_MAX_TOKENS:
        weights, ids, logits = topk_route_partials(router_partials(h, lw["router"]), E, "softmax", K)
    else:
        logits = F.linear(h, lw["router"])
        weights, ids = topk_route(logits[:, :E], "softmax", K)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the shared expert beside the routed ones, joined in the combine
        shared = SharedExpertOutput(lin(h, lw["shared"]), None, side)
    shared.gate_logit = logits[:, E:E + 1]
    out = fused_moe(h, lw["w13"], lw["w2"], weights, ids, shared=shared, pairwise_max_tokens=1, interleaved=True)
    return {"q": q, "h": h, "weights": weights, "ids": ids, "shared": shared.out, "gate": shared.gate_logit,
            "out": out, "z": lin(out, lw["wo"]), "cache": cache}


# GEMV, else cuBLAS; the decode attention up to 32 tokens; the partial-sum router up to 64 tokens; 300 x 4 rows: the
# alignment in two kernels
@pytest.mark.parametrize("T", [1, 8, 64, 300])
def test_a_layer_of_pdl_kernels_in_a_cuda_graph_matches_the_same_without_pdl_and_torch(T):
    from moeserve.ops import pdl
    from moeserve.ops.attention.decode_triton import DecodeWorkspace
    gen = torch.Generator(device="cuda").manual_seed(SEED + T)
    lw = _layer(gen)
    m = _kv_metadata(T, torch.Generator().manual_seed(SEED + T))
    x = torch.randn(T, H, generator=gen, device="cuda").bfloat16()
    cached = torch.randn(m["pages"], 2, PAGE, HEADS, D, generator=gen, device="cuda").bfloat16()  # earlier tokens
    caches = {on: cached.clone() for on in (0, 1)}
    wss = {on: DecodeWorkspace(32, HEADS, HEADS, D, torch.device("cuda")) for on in (0, 1)}
    side, capture = torch.cuda.Stream(), torch.cuda.Stream()
    graphs, outs = {}, {}
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        for on in (0, 1):
            with pdl.enabled_as(8192 if on else 0):
                eager = _step(x, caches[on], m, lw, side, wss[on])  # compiles and loads outside the capture
                capture.wait_stream(side)
                eager = {k: v.clone() for k, v in eager.items()}
                graphs[on] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[on], stream=capture):
                    outs[on] = _step(x, caches[on], m, lw, side, wss[on])
            outs[on]["eager"] = eager
    torch.cuda.current_stream().wait_stream(capture)
    torch.cuda.synchronize()
    for name in ("q", "ids", "weights", "out", "z", "cache"):  # eager launches: with PDL as without
        assert torch.equal(outs[1]["eager"][name], outs[0]["eager"][name]), f"seed {SEED}: eager {name}"
    for replay in range(3):
        x.copy_(torch.randn(T, H, generator=gen, device="cuda").bfloat16())
        for on in (1, 0):
            graphs[on].replay()
        torch.cuda.synchronize()
        for name in ("q", "h", "ids", "weights", "shared", "out", "z", "cache"):
            assert torch.equal(outs[1][name], outs[0][name]), f"seed {SEED}: replay {replay}: {name} differs with PDL"
        o = outs[1]
        ref = (reference_moe(o["h"], lw["w13_ref"], lw["w2"], o["weights"], o["ids"], dtype=torch.float32)
               + torch.sigmoid(o["gate"].float()) * (o["h"].float() @ lw["shared"].float().T))
        err = float((o["out"].float() - ref).norm() / ref.norm())
        assert err < BF16_REL_FRO, f"seed {SEED}: replay {replay}: MoE output relative error {err:.3g}"
        z_ref = o["out"].float() @ lw["wo"].float().T
        err = float((o["z"].float() - z_ref).norm() / z_ref.norm())
        assert err < BF16_REL_FRO, f"seed {SEED}: replay {replay}: last GEMM relative error {err:.3g}"
        # the replay's input reached the end of the chain: the output differs from the one before
        assert not torch.equal(o["out"], outs[1]["eager"]["out"])


PIECES = 4  # Qwen1.5-MoE's shared expert: 5,632 rows, four pieces of the expert size


def _fused_shared_layer(gen, lw):
    """The layer's routed experts with a shared expert of ``PIECES * I`` rows appended as ``PIECES`` more experts
    (``SparseMoE.fuse_shared_expert``'s layout), and that shared expert's own weights for the reference."""
    from moeserve.ops.moe.triton_kernels import interleave_gate_up

    def w(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda") / shape[-1] ** 0.5).bfloat16()
    s = PIECES * I
    gate_up, down = w(2 * s, H), w(H, s)
    w13 = torch.cat([gate_up[:s].view(PIECES, I, H), gate_up[s:].view(PIECES, I, H)], dim=1)
    w2 = down.view(H, PIECES, I).transpose(0, 1)
    return {"w13f": interleave_gate_up(torch.cat([lw["w13_ref"], w13])), "w2f": torch.cat([lw["w2"], w2]).contiguous(),
            "gate_up": gate_up, "down": down}


def _fused_step(x, lw, fl, early):
    """A one-token step's MoE block with the shared expert fused (the norm stands in as a GEMV and an add, the
    router's partial sums, routing, the fused MoE) with its shared-expert tiles started early or not."""
    from moeserve.ops.linear_triton import gemv
    from moeserve.ops.moe.routing_triton import router_partials, topk_route_partials
    from moeserve.ops.moe.triton_kernels import fused_moe
    h = gemv(x, lw["wo"]) + x
    weights, ids, logits = topk_route_partials(router_partials(h, lw["router"]), E, "softmax", K, shared=PIECES,
                                               gated=True, let_early=early)
    out = fused_moe(h, fl["w13f"], fl["w2f"], weights, ids, pairwise_max_tokens=1, interleaved=True,
                    fixed_tail=PIECES if early else 0)
    return {"h": h, "weights": weights, "ids": ids, "logits": logits, "out": out}


def test_a_fused_shared_expert_started_before_the_routing_matches_it_started_after_in_a_cuda_graph():
    """One-token steps with the shared expert fused into the MoE (``moe_fused_shared_early``): the routing kernel
    lets the MoE start at once and the shared expert's tiles stream their weights before waiting for it. Captured
    with PDL, replayed with fresh inputs, the step's outputs are bit-identical to the same chain without PDL and
    without early tiles (a tile that read the layer's input before its writer had finished would see the previous
    replay's), and the MoE output matches the float32 formula of routed plus gated shared expert."""
    from moeserve.ops import pdl
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    lw = _layer(gen)
    fl = _fused_shared_layer(gen, lw)
    x = torch.randn(1, H, generator=gen, device="cuda").bfloat16()
    capture = torch.cuda.Stream()
    arms = {"pdl-early": (8192, True), "pdl": (8192, False), "plain": (0, False)}
    graphs, outs = {}, {}
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        for arm, (bound, early) in arms.items():
            with pdl.enabled_as(bound):
                _fused_step(x, lw, fl, early)  # compiles and loads outside the capture
                graphs[arm] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[arm], stream=capture):
                    outs[arm] = _fused_step(x, lw, fl, early)
    torch.cuda.current_stream().wait_stream(capture)
    torch.cuda.synchronize()
    before = None
    for replay in range(20):
        x.copy_(torch.randn(1, H, generator=gen, device="cuda").bfloat16())
        for arm in arms:
            graphs[arm].replay()
        torch.cuda.synchronize()
        for arm in ("pdl-early", "pdl"):
            for name in ("h", "ids", "weights", "out"):
                assert torch.equal(outs[arm][name], outs["plain"][name]), f"seed {SEED}: replay {replay}: {arm} {name}"
        o = outs["pdl-early"]
        assert o["ids"][0, K:].tolist() == list(range(E, E + PIECES))
        h = o["h"].float()
        shared = (F.silu(h @ fl["gate_up"][:PIECES * I].float().T) * (h @ fl["gate_up"][PIECES * I:].float().T)
                  ) @ fl["down"].float().T
        ref = (reference_moe(o["h"], lw["w13_ref"], lw["w2"], o["weights"][:, :K], o["ids"][:, :K],
                             dtype=torch.float32) + torch.sigmoid(o["logits"][:, E:E + 1].float()) * shared)
        err = float((o["out"].float() - ref).norm() / ref.norm())
        assert err < BF16_REL_FRO, f"seed {SEED}: replay {replay}: MoE output relative error {err:.3g}"
        assert before is None or not torch.equal(o["out"], before)  # the replay's input reached the output
        before = o["out"].clone()
