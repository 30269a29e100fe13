"""A one-token MoE step with the routing inside the first expert GEMM's grid (``routed_moe_triton``,
``moe_route_in_grid``) against the kernels it replaces: the router's partial sums and the routing kernel
(``routing_triton``), then ``triton_kernels.fused_moe`` on that routing.

CPU: under Triton's interpreter in one subprocess (which runs the programs one after another, so the routed tiles
find the routing done). GPU (``-m gpu``): Qwen1.5-MoE's layer with PDL, eagerly and in a CUDA graph replayed with
fresh inputs. Both require the same logits, weights, ids and output bit for bit, and the flags back at zero.
GPU, in a subprocess: routed tiles that never see the routing end the launch with an error instead of hanging.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from triton_interpreter import is_worker, patch_for_numpy, run_worker, worker_env  # noqa: E402

SEED = int(os.environ.get("MOESERVE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
CFG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
# name: (H, I, E routed, router rows, top-k, pieces, method, renormalize, gated, dtype)
CASES = {
    "qwen15-like-gated": (128, 40, 12, 16, 4, 2, "softmax", False, True, torch.float16),
    "renorm-ungated-odd-H": (72, 24, 8, 16, 2, 1, "softmax", True, False, torch.float32),
    "llama4-one-piece": (64, 32, 6, 16, 1, 3, "llama4", False, False, torch.float32),
}


def make_case(H, I, E, rows, k, pieces, gated, dtype, gen, device="cpu"):
    from moeserve.ops.moe.triton_kernels import interleave_gate_up
    x = torch.randn(1, H, generator=gen, device=device).to(dtype)
    router = torch.randn(rows, H, generator=gen, device=device) / H ** 0.5 * 4
    router[E + (1 if gated else 0):] = 0
    w13 = (torch.randn(E + pieces, 2 * I, H, generator=gen, device=device) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E + pieces, H, I, generator=gen, device=device) / I ** 0.5).to(dtype)
    return x, router.to(dtype), interleave_gate_up(w13), w2


# the down GEMM after the grid: (name, preload, combine, add_norm); the first runs neither (as before DOWN_PRELOAD and
# DOWN_COMBINE, the defaults, which the tests calling fused_moe_routed without them run)
DOWN_VARIANTS = [("", False, False, False), ("preload", True, False, False), ("combine", False, True, False),
                 ("preload-combine-norm", True, True, True), ("combine-norm", False, True, True)]
EPS = 1e-6


def separate(x, router, w13, w2, E, k, pieces, method, renorm, gated, config, add_norm=None):
    """The kernels the routed grid replaces: ``(out, weights, ids, logits)``."""
    from moeserve.ops.moe.routing_triton import router_partials, topk_route_partials
    from moeserve.ops.moe.triton_kernels import fused_moe
    weights, ids, logits = topk_route_partials(router_partials(x, router), E, method, k, renorm, shared=pieces,
                                               gated=gated)
    out = fused_moe(x, w13, w2, weights, ids, config=config, pairwise_max_tokens=1, interleaved=True,
                    add_norm=add_norm)
    return out, weights, ids, logits


def norm_inputs(H, dtype, gen, device="cpu"):
    """A residual row and a norm weight for the variants with ``add_norm``."""
    res = torch.randn(1, H, generator=gen, device=device).to(dtype)
    return res, (1 + 0.1 * torch.randn(H, generator=gen, device=device)).to(dtype)


def run_variant(x, router, w13, w2, E, k, pieces, method, renorm, gated, config, sync, variant, res, nw):
    """``(routed grid's 4 outputs, residual after it, separate kernels' 4 outputs, residual after them)`` of one
    :data:`DOWN_VARIANTS` entry (the residuals None without ``add_norm``)."""
    from moeserve.ops.moe.combine import AddNorm
    _, preload, combine, norm = variant
    r1, r2 = (res.clone(), res.clone()) if norm else (None, None)
    got = fused_moe_routed_variant(x, router, w13, w2, E, k, method, renorm, pieces, gated, config, sync,
                                   AddNorm(r1, nw, EPS) if norm else None, preload, combine)
    want = separate(x, router, w13, w2, E, k, pieces, method, renorm, gated, config,
                    AddNorm(r2, nw, EPS) if norm else None)
    return got, r1, want, r2


def fused_moe_routed_variant(x, router, w13, w2, E, k, method, renorm, pieces, gated, config, sync, add_norm,
                             preload, combine):
    from moeserve.ops.moe.routed_moe_triton import fused_moe_routed
    return fused_moe_routed(x, router, w13, w2, E, k, method, renorm, pieces, gated, config, sync, add_norm=add_norm,
                            preload=preload, combine=combine)


def _interpreter_worker(in_path: str, out_path: str) -> None:
    patch_for_numpy()
    from moeserve.ops.moe import triton_kernels
    from moeserve.ops.moe.combine_triton import moe_combine_triton
    from moeserve.ops.moe.routed_moe_triton import fused_moe_routed, new_sync

    def triton_combine(down, top_k, shared=None, out=None, add_norm=None):  # the GPU's combine, not the CPU reference
        assert shared is None
        return moe_combine_triton(down, top_k, out=out, add_norm=add_norm)
    triton_kernels.moe_combine = triton_combine
    inputs = torch.load(in_path)
    out = {}
    for name, (x, router, w13, w2, E, k, pieces, method, renorm, gated, res, nw) in inputs.items():
        sync = new_sync("cpu")
        runs = [fused_moe_routed(x, router, w13, w2, E, k, method, renorm, pieces, gated, CFG, sync) for _ in range(2)]
        variants = {v[0]: run_variant(x, router, w13, w2, E, k, pieces, method, renorm, gated, CFG, sync, v, res, nw)
                    for v in DOWN_VARIANTS[1:]}
        out[name] = (runs, separate(x, router, w13, w2, E, k, pieces, method, renorm, gated, CFG), sync.clone(),
                     variants)
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    gen = torch.Generator().manual_seed(SEED)
    inputs = {}
    for name, (H, I, E, rows, k, pieces, method, renorm, gated, dtype) in CASES.items():
        inputs[name] = (*make_case(H, I, E, rows, k, pieces, gated, dtype, gen), E, k, pieces, method, renorm, gated,
                        *norm_inputs(H, dtype, gen))
    return inputs, run_worker(__file__, inputs, tmp_path_factory.mktemp("routed"), SEED, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_routing_in_the_experts_grid_matches_the_separate_kernels_interpreter(interpreted, name):
    """Twice on one set of flags: the output, weights, ids and logits of the separate kernels, bit for bit; the
    ids hold the pieces after the routed experts; the flags are back at zero."""
    inputs, outputs = interpreted
    x, router, w13, w2, E, k, pieces, *_ = inputs[name]
    runs, ref, sync, _ = outputs[name]
    for run in runs:
        for what, got, want in zip(("output", "weights", "ids", "logits"), run, ref):
            assert torch.equal(got, want), f"seed {SEED}: {what} differs from the separate kernels'"
    assert runs[0][2][0, k:].tolist() == list(range(E, E + pieces))
    assert sync.count_nonzero() == 0


@pytest.mark.parametrize("variant", [v[0] for v in DOWN_VARIANTS[1:]])
@pytest.mark.parametrize("name", list(CASES))
def test_down_gemm_variants_match_the_separate_kernels_interpreter(interpreted, name, variant):
    """The down GEMM after the grid loading its first weight tile before its wait (``preload``) and/or running the
    combine in its last program (``combine``; with the next norm, ``-norm``): the same output (and residual) as the
    separate kernels with the combine kernel (``moe_fuse_norm``'s with the norm), bit for bit; the flags, the down
    GEMM's counter among them, back at zero (checked after every variant ran on them)."""
    inputs, outputs = interpreted
    _, _, sync, variants = outputs[name]
    (got, r1, want, r2) = variants[variant]
    for what, a, b in zip(("output", "weights", "ids", "logits"), got, want):
        assert torch.equal(a, b), f"seed {SEED}: {variant}: {what} differs from the separate kernels'"
    if r1 is not None:
        assert torch.equal(r1, r2), f"seed {SEED}: {variant}: the residual differs"
        assert not torch.equal(r1, inputs[name][10]), "the residual was not updated"
    assert sync.count_nonzero() == 0


def test_what_it_does_not_take_is_named():
    from moeserve.ops.moe.routed_moe_triton import fused_moe_routed, new_sync
    x, router, w13, w2 = make_case(64, 32, 6, 16, 2, 1, False, torch.float32, torch.Generator().manual_seed(0))
    sync = new_sync("cpu")
    with pytest.raises(ValueError, match="flags of 3"):
        fused_moe_routed(x, router, w13, w2, 6, 2, "softmax", False, 1, False, {}, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="2 tokens"):
        fused_moe_routed(x.expand(2, -1), router, w13, w2, 6, 2, "softmax", False, 1, False, {}, sync)
    with pytest.raises(ValueError, match="7 experts in w13, expected 6 routed \\+ 2 pieces"):
        fused_moe_routed(x, router, w13, w2, 6, 2, "softmax", False, 2, False, {}, sync)
    with pytest.raises(ValueError, match="routing is deepseek_v3"):
        fused_moe_routed(x, router, w13, w2, 6, 2, "deepseek_v3", False, 1, False, {}, sync)


def same_or_norm_ulp(a: torch.Tensor, b: torch.Tensor, normed: bool) -> bool:
    """Bit for bit; a normed output (``add_norm``) may differ by one bf16 rounding step where the two kernels sum
    the squares in another order (the residual, an elementwise sum, may not)."""
    if torch.equal(a, b):
        return True
    return normed and bool(((a.float() - b.float()).abs() <= b.float().abs() * 2 ** -7 + 1e-6).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", DOWN_VARIANTS, ids=[v[0] or "neither" for v in DOWN_VARIANTS])
def test_routing_in_the_experts_grid_on_the_gpu_in_a_cuda_graph(variant):
    """Qwen1.5-MoE's layer (60 experts, top-4, the shared expert's gate a router row, four pieces), the tuned
    one-token tiles, PDL: eagerly and over 50 CUDA-graph replays with fresh tokens, bit for bit the separate
    kernels' routing and output (the down GEMM as each of :data:`DOWN_VARIANTS` runs it; with the next norm, the
    residual bit for bit and the normed output within one bf16 step), and the flags at zero after each."""
    from moeserve.ops import pdl
    from moeserve.ops.moe.combine import AddNorm
    from moeserve.ops.moe.routed_moe_triton import new_sync
    from moeserve.ops.moe.triton_configs import get_config
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    H, I, E, k, pieces = 2048, 1408, 60, 4, 4
    x, router, w13, w2 = make_case(H, I, E, 64, k, pieces, True, torch.bfloat16, gen, "cuda")
    res, nw = norm_inputs(H, torch.bfloat16, gen, "cuda")
    _, preload, combine, norm = variant
    r = [res.clone() for _ in range(4)]  # eager ours, eager theirs, graph ours, graph theirs
    an = [AddNorm(ri, nw, EPS) if norm else None for ri in r]
    cfg = get_config(1, E, I, H, k, torch.bfloat16)[0]
    sync = new_sync("cuda")
    args = (E, k, "softmax", False, pieces, True, cfg, sync)

    def ours(add_norm):
        return fused_moe_routed_variant(x, router, w13, w2, E, k, "softmax", False, pieces, True, cfg, sync, add_norm,
                                        preload, combine)
    with pdl.enabled_as(64):
        eager = ours(an[0])
        ref = separate(x, router, w13, w2, E, k, pieces, "softmax", False, True, cfg, an[1])
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = ours(an[2])
            want = separate(x, router, w13, w2, *args[:2], pieces, "softmax", False, True, cfg, an[3])
    torch.cuda.synchronize()
    for a, b in zip(eager, ref):
        assert same_or_norm_ulp(a, b, norm), f"seed {SEED}: eager"
    assert torch.equal(r[0], r[1]), f"seed {SEED}: eager: the residual"
    for replay in range(50):
        x.copy_(torch.randn(1, H, generator=gen, device="cuda").bfloat16())
        g.replay()
        torch.cuda.synchronize()
        for what, a, b in zip(("output", "weights", "ids", "logits"), got, want):
            assert same_or_norm_ulp(a, b, norm and what == "output"), f"seed {SEED}: replay {replay}: {what}"
        assert torch.equal(r[2], r[3]), f"seed {SEED}: replay {replay}: the residual"
        assert sync.count_nonzero() == 0


STUCK_FLAG = "--stuck-worker"


def _stuck_worker() -> None:
    """Once with fresh flags (completes), then with the router's done counter past its last slice, so no program
    sets the ready flag: exits 3 with the CUDA error's first line if that launch fails, 0 if it completes."""
    from moeserve.ops.moe.routed_moe_triton import fused_moe_routed, new_sync
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    x, router, w13, w2 = make_case(256, 64, 8, 16, 2, 1, False, torch.bfloat16, gen, "cuda")
    sync = new_sync("cuda")
    args = (8, 2, "softmax", False, 1, False, CFG, sync)
    fused_moe_routed(x, router, w13, w2, *args, spin_limit=1 << 12)
    torch.cuda.synchronize()
    print("fresh flags: completed", flush=True)
    sync[0] = 1 << 20
    try:
        fused_moe_routed(x, router, w13, w2, *args, spin_limit=1 << 12)
        torch.cuda.synchronize()
    except Exception as e:  # torch's CUDA errors (AcceleratorError, a RuntimeError)
        print("stuck flags: launch failed:", str(e).strip().splitlines()[0], flush=True)
        sys.exit(3)
    print("stuck flags: completed", flush=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_routed_tiles_that_never_see_the_routing_fail_the_launch_instead_of_hanging():
    """The routed tiles' wait is bounded (``spin_limit`` reads of the ready flag, then a trap): with flags on which
    no program will ever set it, the launch fails with a CUDA error within seconds, where an unbounded wait hangs
    (the subprocess's timeout). A subprocess, as the trap ends its CUDA context; the same launch on fresh flags
    completes there first."""
    env = worker_env(MOESERVE_TEST_SEED=str(SEED))
    try:
        proc = subprocess.run([sys.executable, __file__, STUCK_FLAG], env=env, capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"seed {SEED}: the launch on stuck flags hung for 120 s")
    out = proc.stdout + proc.stderr[-2000:]
    assert "fresh flags: completed" in proc.stdout, out
    assert proc.returncode == 3 and "stuck flags: launch failed: CUDA error" in proc.stdout, out


if __name__ == "__main__" and is_worker(sys.argv):
    _interpreter_worker(sys.argv[2], sys.argv[3])
elif __name__ == "__main__" and sys.argv[1:] == [STUCK_FLAG]:
    _stuck_worker()
