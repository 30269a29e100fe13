"""Triton kernels ahead of time: ``precompile`` lists and builds, on this GPU-less machine, the Triton kernels a
configuration launches; a build moved to another path still serves every launch from disk; with
``allow_jit: false`` a kernel or configuration the cache lacks is refused by name."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from moeserve.config import make_config  # noqa: E402
from moeserve.kernel_cache import triton_cache  # noqa: E402
from moeserve.ops import pdl  # noqa: E402
from moeserve.tools import triton_aot  # noqa: E402
from moeserve.tools.modules import plan_for_arch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
H200 = ((9, 0), "NVIDIA_H200")


def tiny_plan(max_tokens=24, **kw):
    return plan_for_arch(make_config(model="tiny", dtype="bfloat16", max_num_batched_tokens=max_tokens,
                                     max_num_seqs=8, **kw), "9.0a")


def test_dry_run_lists_the_triton_kernels_of_the_bench_configuration(tmp_path):
    cache = tmp_path / "cache"
    out = subprocess.run([sys.executable, "-m", "moeserve.cli", "precompile", "--config",
                          "moeserve/presets/bench-gpu.yaml", "--arch", "9.0a", "--out", str(cache),
                          "--dry-run", "--modules", "norm"],
                         capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={"COLUMNS": "300", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert not cache.exists()  # a dry run leaves no cache directory behind (FlashInfer's planned sources included)
    text = out.stdout
    assert "Triton kernels for qwen1.5-moe-a2.7b on 9.0a (NVIDIA_H200), steps of 1 to 8192 tokens" in text
    for kernel in ("_topk_route_kernel", "_moe_align_one_pass_kernel", "_moe_align_kernel", "_moe_count_kernel",
                   "fused_moe_kernel", "moe_combine_kernel", "qkv_rope_append_kernel", "_router_partial_kernel",
                   "_topk_route_partials_kernel"):
        assert kernel in text, kernel
    # the SwiGLU activation is in the first expert GEMM's epilogue (no separate kernel for bf16 experts, whose gate
    # and up rows the backend interleaves); one-token steps run that GEMM, with the router and the routing in its
    # grid, at the tuned tile (the shared expert's four pieces fused, its gate a router row); the attention's QKV
    # kernel at Qwen1.5's heads
    assert "_silu_and_mul_kernel" not in text
    assert "_route_moe_kernel" in text and "TOPK=4 PIECES=4" in text and "GATED=True BLOCK_SIZE_M=16 " \
        "BLOCK_SIZE_N=32 BLOCK_SIZE_K=128 EVEN_K=True PDL=True" in text
    assert "GROUP_SIZE_M=1 MUL_ROUTED_WEIGHT=False EVEN_K=True IEEE_FP32=False PAIRWISE=True SILU_MUL=True" in text
    assert "HQ=16 HKV=16 D=128 ROT=128 PAGE=16" in text and "QK_NORM=False" in text
    # Qwen1.5's gated shared expert: the combine adds it with the gate from the router's extra row
    assert "TOP_K=4 HAS_SHARED=True HAS_GATE=True" in text
    assert "PDL=True launch_pdl=True" in text and "PDL=False" not in text  # sm90: programmatic dependent launch
    # steps of up to 64 tokens launch with PDL, larger ones without: the QKV kernel (one for every step size) both ways
    qkv = [line for line in text.splitlines() if "qkv_rope_append_kernel" in line]
    assert len(qkv) == 2 and sum("PDL=True" in line for line in qkv) == 1, qkv
    assert "BLOCK_SIZE_M=16 BLOCK_SIZE_N=32 BLOCK_SIZE_K=128" in text  # the tuned H200 table's M=1 tile
    assert "PAIRWISE=True" in text and "PAIRWISE=False" in text  # one-token steps skip the alignment
    # the triton linear backend's GEMV (auto on a GPU, one-token steps): qkv_proj (6,144 rows, a bias) runs the
    # tl.dot GEMV, the 2,048-row projections the one-row kernel with the whole K of 2,048 in one tile
    gemv_lines = [line for line in text.splitlines() if "_gemv_kernel" in line]
    row_lines = [line for line in text.splitlines() if "_gemv_row_kernel" in line]
    assert any("HAS_BIAS=True" in line for line in gemv_lines), gemv_lines
    assert any("BLOCK_N=4 BLOCK_K=2048" in line for line in row_lines), row_lines
    assert all("PRELOAD=True" in line for line in row_lines), row_lines  # weights before the PDL wait
    assert not any("PRELOAD" in line for line in gemv_lines), gemv_lines


def test_built_kernels_serve_every_launch_from_disk_after_the_cache_moves(tmp_path):
    plan = tiny_plan()
    config = triton_aot.build(plan, tmp_path / "built", *H200, log=lambda s: None)
    names = {e["kernel"] for e in config["entries"]}
    # steps of up to 24 tokens: the router's GEMM as partial sums, added by the routing kernel (no cuBLAS logits);
    # their routings are small enough for the one-pass alignment
    assert {"fused_moe_kernel", "_moe_align_one_pass_kernel", "moe_combine_kernel", "_router_partial_kernel",
            "_topk_route_partials_kernel"} <= names and "_topk_route_kernel" not in names
    assert "_moe_align_kernel" not in names
    manifest = json.loads((tmp_path / "built" / "triton" / "manifest.json").read_text())
    # each kernel names the MoE step size that first launches it: the sizes the engine warms at start
    # (the one-row GEMV, which the tiny model's LM head of 512 rows runs in one-token steps, and the decode graphs'
    # input feed belong to no MoE step: None)
    sizes = [e["tokens"] for e in config["entries"] if e["kernel"] not in ("_gemv_row_kernel", "_feed_kernel")]
    assert sizes[0] == 1 and all(isinstance(t, int) and 1 <= t <= 24 for t in sizes)
    assert [e["tokens"] for e in config["entries"] if e["kernel"] == "_feed_kernel"] == [None]  # one compile
    assert [e["tokens"] for e in config["entries"] if "gemv" in e["kernel"]] == [None]
    assert sorted(set(sizes)) == sorted({e["tokens"] for e in manifest["configs"][-1]["entries"]} - {None})
    assert manifest["target_python"] == triton_aot.python_tag()
    assert manifest["triton_key_sha256"] == triton_cache.triton_key_digest()
    shutil.copytree(tmp_path / "built", tmp_path / "moved")
    shutil.rmtree(tmp_path / "built")
    assert triton_cache.relocate(tmp_path / "moved" / "triton") == len(config["entries"])
    assert triton_cache.check_coverage(manifest, plan.triton_fingerprint(H200[1]), tmp_path / "moved" / "triton") == []
    again = triton_aot.build(plan, tmp_path / "moved", *H200, log=lambda s: None)  # fresh in-memory state
    assert [e["hash"] for e in again["entries"]] == [e["hash"] for e in config["entries"]]
    assert plan.pdl_max_tokens >= 24  # sm90: every step's kernels launch with PDL, compiles of their own
    with triton_aot.compile_session(tmp_path / "moved" / "triton", (9, 0), triton_aot.target_triton_key(None)[0]) \
            as events:
        import torch
        layer = triton_aot.meta_moe_layer(plan)
        with torch.no_grad(), triton_aot.tuned_tables_for(H200[1]), pdl.enabled_as(plan.pdl_max_tokens):
            for t in (1, 7, 24):
                layer(torch.empty((t, plan.arch.hidden_size), dtype=plan.dtype, device="meta"))
    assert events and all(e["cache_hit"] for e in events), [e for e in events if not e["cache_hit"]]


def test_kernels_launch_with_pdl_on_hopper_for_steps_up_to_pdl_max_tokens(tmp_path):
    """On sm90 the kernels of steps of up to ``pdl_max_tokens`` tokens are compiled with ``PDL=True`` (each waits
    for the kernel before it) and Triton's ``launch_pdl``, larger steps' without; ``pdl_max_tokens: 0`` lists the
    same kernels without it, and the fingerprint tells the configurations apart. Below sm90 there is no PDL."""
    every, off, small = tiny_plan(), tiny_plan(pdl_max_tokens=0), tiny_plan(pdl_max_tokens=4)
    assert (every.pdl_max_tokens, off.pdl_max_tokens, small.pdl_max_tokens) == (64, 0, 4)
    fps = [p.triton_fingerprint(H200[1]) for p in (every, off, small)]
    assert [fp["pdl_max_tokens"] for fp in fps] == [24, 0, 4]  # 24: the largest step
    assert all({k: v for k, v in fp.items() if k != "pdl_max_tokens"}
               == {k: v for k, v in fps[0].items() if k != "pdl_max_tokens"} for fp in fps)

    def listed(plan, name):
        return triton_aot.list_kernels(plan, *H200, tmp_path / name)

    def with_pdl(k):
        has = k["constants"].get("PDL") == "True"
        assert has == (k["constants"].get("launch_pdl") == "True"), k
        return has

    def step_kernels(ks):  # the decode graphs' input feed runs before a replay, after a copy: never with PDL
        assert [k for k in ks if k["name"] == "_feed_kernel" and with_pdl(k)] == []
        return [k for k in ks if k["name"] != "_feed_kernel"]

    every_k, off_k, small_k = (step_kernels(listed(p, name)) for p, name in ((every, "every"), (off, "off"),
                                                                             (small, "small")))
    assert every_k and all(with_pdl(k) for k in every_k)
    assert not any(with_pdl(k) for k in off_k)
    names = lambda ks, pdl_on: {k["name"] for k in ks if with_pdl(k) == pdl_on}  # noqa: E731
    assert names(every_k, True) == names(off_k, False)  # the same kernels, launched the other way
    # small steps launch every kernel kind but the MoE alignment, which steps of up to moe_pairwise_max_tokens (16)
    # skip; larger steps align, without PDL
    assert small.config.moe_pairwise_max_tokens == 16
    assert names(small_k, True) == names(off_k, False) - {"_moe_align_one_pass_kernel"}
    assert "_moe_align_one_pass_kernel" in names(small_k, False)  # steps of 17 to 24 tokens
    assert pdl.max_tokens() == 0  # listing leaves the process's setting as it was
    assert plan_for_arch(make_config(model="tiny", dtype="bfloat16"), "8.0").pdl_max_tokens == 0


def test_the_qkv_kernel_is_listed_only_where_attention_takes_the_projection_whole(tmp_path):
    """FlashInfer attention with FlashInfer rotary: the QKV kernel is in the plan (one entry, any step size);
    ``attention_fused_qkv: false`` or the torch rotary backend leave it out, and the fingerprint says so."""
    def qkv_entries(**kw):  # Qwen1.5-MoE's shapes (the tiny model's head_dim 16 runs the torch attention)
        plan = plan_for_arch(make_config(model="qwen1.5-moe-a2.7b", dtype="bfloat16", max_num_batched_tokens=2,
                                         max_num_seqs=2, **kw), "9.0a")
        listed = triton_aot.list_kernels(plan, *H200, tmp_path / str(len(kw)))
        return (plan.triton_fingerprint(H200[1])["fused_qkv"],
                [k for k in listed if k["name"] == "qkv_rope_append_kernel"])

    fused, entries = qkv_entries()
    assert fused and len(entries) == 1
    for kw in ({"attention_fused_qkv": False}, {"backends": {"rope": "torch"}}):
        fused, entries = qkv_entries(**kw)
        assert not fused and entries == [], kw


def test_the_add_norm_kernel_is_listed_for_small_steps_with_the_flashinfer_norm(tmp_path):
    """``norm_triton_max_tokens`` (default 64, bounded by the largest step) puts the Triton residual add + RMSNorm
    and the embedding with the first norm in the plan, with PDL for steps up to ``pdl_max_tokens`` and without beyond; 0 or the torch norm backend leave
    it out, and the fingerprint says so."""
    def norm_entries(**kw):
        plan = plan_for_arch(make_config(model="qwen1.5-moe-a2.7b", dtype="bfloat16", max_num_batched_tokens=32,
                                         max_num_seqs=32, **kw), "9.0a")
        listed = triton_aot.list_kernels(plan, *H200, tmp_path / str(sorted(kw.items())))
        pdl = {name: sorted(k["constants"].get("PDL") == "True" for k in listed if k["name"] == name)
               for name in ("_add_rmsnorm_kernel", "_embed_rmsnorm_kernel")}
        assert pdl["_embed_rmsnorm_kernel"] == pdl["_add_rmsnorm_kernel"], pdl  # the step's first norm, the same steps
        return plan.triton_fingerprint(H200[1])["norm_triton_max_tokens"], pdl["_add_rmsnorm_kernel"]

    assert norm_entries() == (32, [True])  # the default 64, bounded by the largest step (32 tokens)
    assert norm_entries(pdl_max_tokens=8) == (32, [False, True])  # steps of 9 to 32 tokens launch it without PDL
    assert norm_entries(norm_triton_max_tokens=4) == (4, [True])
    for kw in ({"norm_triton_max_tokens": 0}, {"backends": {"norm": "torch"}}):
        assert norm_entries(**kw) == (0, []), kw


def test_the_down_gemm_runs_the_combine_and_norm_of_one_token_steps_that_route_in_the_grid(tmp_path):
    """``moe_fuse_norm_in_grid`` (default on where ``moe_route_in_grid`` applies): the plan lists the down GEMM with
    its weights loaded before its wait and the combine and the next norm in its last program; off, or with the
    one-kernel attention half (which applies the input norm itself), the down GEMM runs the combine alone."""
    def down_entries(**kw):
        plan = plan_for_arch(make_config(model="qwen1.5-moe-a2.7b", dtype="bfloat16", max_num_batched_tokens=2,
                                         max_num_seqs=2, **kw), "9.0a")
        listed = triton_aot.list_kernels(plan, *H200, tmp_path / str(sorted(kw.items())))
        return (plan.triton_fingerprint(H200[1])["fuse_norm_in_grid"],
                sorted((k["constants"].get("PRELOAD_B"), k["constants"].get("COMBINE"), k["constants"].get("ADD_NORM"))
                       for k in listed if k["name"] == "fused_moe_kernel" and "COMBINE" in k["constants"]))

    assert down_entries() == (True, [("True", "8", "True")])
    for kw in ({"moe_fuse_norm_in_grid": False}, {"attention_layer_kernel": True}):
        assert down_entries(**kw) == (False, [("True", "8", "False")]), kw


def test_the_lm_head_is_among_the_gemv_shapes_precompile_builds(monkeypatch):
    """``compute_logits`` runs the LM head through the linear backend, so the GEMV of one-token steps covers its
    ``[vocab, hidden]`` weight (151,936 x 2,048 for Qwen1.5-MoE) and ``precompile`` builds it; ``GEMV_MAX_N``
    below the vocabulary leaves it to cuBLAS."""
    import torch
    from moeserve.ops import linear_triton
    plan = plan_for_arch(make_config(model="qwen1.5-moe-a2.7b", dtype="bfloat16", max_num_batched_tokens=32,
                                     max_num_seqs=32), "9.0a")
    shapes = triton_aot.meta_linear_shapes(plan, plan.triton_fingerprint(H200[1]))
    assert (151936, 2048, False, torch.bfloat16) in shapes, shapes
    lin = linear_triton.TritonLinear(torch.device("meta"), torch.bfloat16, max_tokens=1)
    assert lin.takes_shape(1, 151936, torch.bfloat16, torch.bfloat16)
    monkeypatch.setattr(linear_triton, "GEMV_MAX_N", 16384)
    assert not lin.takes_shape(1, 151936, torch.bfloat16, torch.bfloat16)


def test_tensor_parallel_plans_build_the_gemvs_of_a_ranks_split(tmp_path):
    """With ``tensor_parallel_size: 2`` each rank's linears are its split: the QKV projection's 3,072 rows (which
    one-row steps run through the one-row kernel, with its bias), the output projection's 1,024 columns (not a
    whole K tile: ``EVEN_K=False``), the LM head's 75,968 vocabulary rows; ``precompile`` lists those kernels and
    not the one-rank shapes' (the QKV projection through ``_gemv_kernel``)."""
    import torch
    plan = plan_for_arch(make_config(model="qwen1.5-moe-a2.7b", dtype="bfloat16", max_num_batched_tokens=32,
                                     max_num_seqs=32, tensor_parallel_size=2), "9.0a")
    shapes = triton_aot.meta_linear_shapes(plan, plan.triton_fingerprint(H200[1]))
    bf = torch.bfloat16
    assert {(3072, 2048, True, bf), (2048, 1024, False, bf), (75968, 2048, False, bf)} <= set(shapes), shapes
    assert (6144, 2048, True, bf) not in shapes and (151936, 2048, False, bf) not in shapes
    listed = [k for k in triton_aot.list_kernels(plan, *H200, tmp_path) if "gemv" in k["name"]]
    consts = {(k["name"], k["constants"].get("HAS_BIAS"), k["constants"].get("EVEN_K")) for k in listed}
    assert consts == {("_gemv_row_kernel", "True", "True"), ("_gemv_row_kernel", "False", "False"),
                      ("_gemv_kernel", "False", "True")}, consts
    # the fingerprint tells the split apart, so one cache directory holds the TP=1 and TP=2 lists side by side
    # (Qwen3-MoE: no shared expert, whose fusing one rank only would tell them apart too)
    fp1, fp2 = (plan_for_arch(make_config(model="qwen3-30b-a3b", dtype="bfloat16", max_num_batched_tokens=32,
                                          max_num_seqs=32, tensor_parallel_size=tp), "9.0a").triton_fingerprint(H200[1])
                for tp in (1, 2))
    assert (fp1["tensor_parallel_size"], fp2["tensor_parallel_size"]) == (1, 2)
    assert {k: v for k, v in fp1.items() if k != "tensor_parallel_size"} == \
        {k: v for k, v in fp2.items() if k != "tensor_parallel_size"}


def test_tensor_parallel_plans_build_the_moe_kernels_of_a_ranks_experts(tmp_path):
    """A rank's experts are its split too: with ``tensor_parallel_size: 2`` a Qwen1.5-MoE rank's experts have an
    intermediate size of 704 (the down GEMM's K, not a whole tile of 128: ``EVEN_K=False``), with expert
    parallelism 30 whole experts; ``precompile`` builds the MoE layer as that rank (its collectives on ``meta``
    move nothing) and lists its kernels, which the one-rank layer's list lacks. The fingerprint tells the three
    layouts apart."""
    def plan(tp, ep=False):
        return plan_for_arch(make_config(model="qwen1.5-moe-a2.7b", dtype="bfloat16", max_num_batched_tokens=32,
                                         max_num_seqs=32, tensor_parallel_size=tp, enable_expert_parallel=ep),
                             "9.0a")

    one, tp2, ep2 = plan(1), plan(2), plan(2, ep=True)
    assert tuple(triton_aot.meta_moe_layer(one).w2.shape) == (64, 2048, 1408)  # and the shared expert's 4 pieces
    assert tuple(triton_aot.meta_moe_layer(tp2).w2.shape) == (60, 2048, 704)
    assert tuple(triton_aot.meta_moe_layer(ep2).w2.shape) == (30, 2048, 1408)

    def moe_kernels(p, name):
        return {(k["name"], k["constants"].get("BLOCK_SIZE_K"), k["constants"].get("EVEN_K"))
                for k in triton_aot.list_kernels(p, *H200, tmp_path / name) if k["name"] == "fused_moe_kernel"}

    k_one, k_tp2 = moe_kernels(one, "one"), moe_kernels(tp2, "tp2")
    uneven = {k for k in k_tp2 if k[2] == "False"}
    assert uneven and all(704 % int(k[1]) for k in uneven), k_tp2  # the down GEMM over a rank's 704 columns
    assert not uneven & k_one, k_one
    fps = [p.triton_fingerprint(H200[1]) for p in (one, tp2, ep2)]
    assert [(fp["tensor_parallel_size"], fp["expert_parallel_size"]) for fp in fps] == [(1, 1), (2, 1), (2, 2)]


def test_the_qkv_kernel_compiles_for_sm90_with_gqa_and_qk_norm(tmp_path):
    """Qwen3-MoE's attention (32 query heads over 4 kv heads, per-head q/k norms): the kernel compiles for the H200
    (the interpreter runs it without Triton's type checks, so a compile is its own test)."""
    import torch
    plan = plan_for_arch(make_config(model="qwen3-30b-a3b", dtype="bfloat16", max_num_batched_tokens=2,
                                     max_num_seqs=2), "9.0a")
    assert plan.fused_qkv and plan.arch.qk_norm and plan.arch.num_kv_heads < plan.arch.num_heads
    with triton_aot.compile_session(tmp_path, (9, 0), triton_aot.target_triton_key(None)[0]) as events, \
            torch.no_grad(), pdl.enabled_as(plan.pdl_max_tokens):
        triton_aot.launch_qkv_kernel(plan)
    assert [e["name"] for e in events] == ["qkv_rope_append_kernel"]
    consts = list(events[0]["constants"].values())  # HQ, HKV, D, ROT, PAGE, ..., QK_NORM, PDL in signature order
    assert consts[:5] == ["32", "4", "128", "128", "16"] and consts[-2:] == ["True", "True"]


def test_the_decode_kernel_is_listed_with_its_option_and_compiles_for_sm90(tmp_path):
    """``attention_decode_triton_max_tokens``: the one-kernel decode attention is in the plan (one entry for every
    step size it serves; two when PDL stops below its bound) and compiles for the H200 at Qwen3-MoE's attention
    (GQA 32/4, q/k norms) and Qwen1.5-MoE's (MHA); without the option, or without the fused QKV path, it is not."""
    def entries(model, **kw):
        plan = plan_for_arch(make_config(model=model, dtype="bfloat16", max_num_batched_tokens=64, max_num_seqs=64,
                                         **kw), "9.0a")
        listed = triton_aot.list_kernels(plan, *H200, tmp_path / f"{model}-{len(kw)}-{sorted(kw.items())}"[:60])
        return plan, [k for k in listed if k["name"] == "qkv_decode_attention_kernel"]

    plan, found = entries("qwen1.5-moe-a2.7b", attention_decode_triton_max_tokens=32)
    assert plan.triton_decode_max_tokens == 32 and len(found) == 1 and found[0]["constants"]["PDL"] == "True"
    _, found = entries("qwen1.5-moe-a2.7b", attention_decode_triton_max_tokens=32, pdl_max_tokens=8)
    assert sorted(k["constants"].get("PDL", "False") for k in found) == ["False", "True"]
    plan, found = entries("qwen1.5-moe-a2.7b")  # the default: steps of up to 32 tokens
    assert plan.triton_decode_max_tokens == 32 and len(found) == 1
    for kw in ({"attention_decode_triton_max_tokens": 0},
               {"attention_decode_triton_max_tokens": 32, "attention_fused_qkv": False}):
        plan, found = entries("qwen1.5-moe-a2.7b", **kw)
        assert plan.triton_decode_max_tokens == 0 and found == [], kw
    import torch
    plan, _ = entries("qwen3-30b-a3b", attention_decode_triton_max_tokens=16)
    with triton_aot.compile_session(tmp_path / "c", (9, 0), triton_aot.target_triton_key(None)[0]) as events, \
            torch.no_grad(), pdl.enabled_as(plan.pdl_max_tokens):
        triton_aot.launch_decode_kernel(plan, 3)
    assert [e["name"] for e in events] == ["qkv_decode_attention_kernel"]


@pytest.mark.parametrize("form", ["dot", "row"])
def test_the_qkv_gemv_attention_grid_is_listed_with_its_switch_and_compiles_for_sm90(tmp_path, monkeypatch, form):
    """``qkv_gemv_triton.QKV_IN_GRID`` (off by default): on, the plan lists the grid of the QKV GEMV and the decode
    attention beside the decode kernel; it compiles for the H200 at Qwen1.5-MoE's attention (MHA, a QKV bias) and
    Qwen3-MoE's (GQA 32/4, q/k norms) in both GEMV forms, within an SM's shared memory (227 KiB); with
    ``FOUR_PER_SM``, at most 128 registers a thread and a quarter of it."""
    import json

    import torch
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    from moeserve.ops.attention import qkv_gemv_triton as qg
    monkeypatch.setattr(knobs.cache, "manager_class", FileCacheManager)  # whatever guard an earlier test left

    def listed(on):
        monkeypatch.setattr(qg, "QKV_IN_GRID", on)
        plan = plan_for_arch(make_config(model="qwen1.5-moe-a2.7b", dtype="bfloat16", max_num_batched_tokens=64,
                                         max_num_seqs=64), "9.0a")
        return [k for k in triton_aot.list_kernels(plan, *H200, tmp_path / f"list-{on}")
                if k["name"] == "qkv_gemv_attention_kernel"]
    assert listed(False) == []
    found = listed(True)
    assert len(found) == 1 and found[0]["constants"]["PDL"] == "True"
    monkeypatch.setattr(qg, "TILES", form)
    for model in ("qwen1.5-moe-a2.7b", "qwen3-30b-a3b"):
        plan = plan_for_arch(make_config(model=model, dtype="bfloat16", max_num_batched_tokens=2, max_num_seqs=2),
                             "9.0a")
        cache = tmp_path / f"{model}-{form}"
        with triton_aot.compile_session(cache, (9, 0), triton_aot.target_triton_key(None)[0]) as events, \
                torch.no_grad(), pdl.enabled_as(plan.pdl_max_tokens):
            triton_aot.launch_qkv_gemv_kernel(plan)
        assert [e["name"] for e in events] == ["qkv_gemv_attention_kernel"], model
        metas = [json.loads(f.read_text()) for f in cache.rglob("qkv_gemv_attention_kernel.json")]
        assert metas and all(0 < m["shared"] <= 227 * 1024 for m in metas), [m.get("shared") for m in metas]
        # FOUR_PER_SM: at most 128 registers a thread and a quarter of an SM's shared memory
        monkeypatch.setattr(qg, "FOUR_PER_SM", True)
        four = tmp_path / f"{model}-{form}-four"
        with triton_aot.compile_session(four, (9, 0), triton_aot.target_triton_key(None)[0]) as events, \
                torch.no_grad(), pdl.enabled_as(plan.pdl_max_tokens):
            triton_aot.launch_qkv_gemv_kernel(plan)
        monkeypatch.setattr(qg, "FOUR_PER_SM", False)
        metas = [json.loads(f.read_text()) for f in four.rglob("qkv_gemv_attention_kernel.json")]
        assert metas and all(m["maxnreg"] == 128 and 0 < m["shared"] <= 227 * 1024 // 4 for m in metas), \
            [(m.get("maxnreg"), m.get("shared")) for m in metas]


def test_keys_follow_the_target_python(tmp_path):
    other = "3.12" if triton_aot.python_tag() != "cp312" else "3.11"
    if triton_aot.python_tag(other) == "cp312":
        key, tag = triton_aot.target_triton_key(other)
        assert tag == "cp312" and key != triton_aot.target_triton_key(None)[0]
    with pytest.raises(ValueError, match="no libtriton hash for triton .* cp39"):
        triton_aot.target_triton_key("3.9")


def test_allow_jit_false_refuses_an_uncovered_configuration_and_a_missing_kernel_by_name(tmp_path):
    plan = tiny_plan()
    config = triton_aot.build(plan, tmp_path, *H200, log=lambda s: None)
    fp = plan.triton_fingerprint(H200[1])
    summary = triton_cache.use_triton_cache(tmp_path, fp, allow_jit=False)
    assert summary["kernels"] == len(config["entries"])
    assert triton_cache.warm_step_sizes() == sorted({e["tokens"] for e in config["entries"]} - {None})
    bigger = tiny_plan(max_tokens=64).triton_fingerprint(H200[1])
    with pytest.raises(triton_cache.TritonCacheError, match="holds no Triton kernels for .*max_tokens=64"):
        triton_cache.use_triton_cache(tmp_path, bigger, allow_jit=False)
    victim = next(e for e in config["entries"] if e["kernel"] == "moe_combine_kernel")
    (tmp_path / "triton" / victim["dir"] / f"{victim['name']}.cubin").unlink()
    with pytest.raises(triton_cache.TritonCacheError, match=f"missing from .*moe_combine_kernel \\({victim['dir']}\\)"):
        triton_cache.use_triton_cache(tmp_path, fp, allow_jit=False)
    with pytest.raises(triton_cache.TritonCacheError, match="no Triton kernels"):
        triton_cache.use_triton_cache(tmp_path / "empty", fp, allow_jit=False)


def test_the_runtime_guard_refuses_a_miss_before_anything_compiles(tmp_path, monkeypatch):
    from triton import knobs
    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    saved = (knobs.cache.manager_class, knobs.compilation.listener, dict(triton_cache._state))
    try:
        triton_cache.install_listener(allow_jit=False)
        manager = knobs.cache.manager_class("somekey")
        with pytest.raises(triton_cache.TritonCacheError, match="Triton kernel fused_moe_kernel .* allow_jit is false"):
            manager.get_group("fused_moe_kernel.json")
    finally:
        knobs.cache.manager_class, knobs.compilation.listener = saved[0], saved[1]
        triton_cache._state.update(saved[2])


def test_the_launcher_sources_are_the_ones_triton_builds_at_first_load(tmp_path, monkeypatch):
    """Each kernel's launcher source, as precompile writes it, is what Triton's own ``CudaLauncher`` generates
    from the same kernel source and metadata (its C compile intercepted: this machine has no driver)."""
    import types

    from triton import knobs
    from triton.backends.nvidia import driver
    from triton.runtime.cache import FileCacheManager
    monkeypatch.setattr(knobs.cache, "manager_class", FileCacheManager)  # an earlier test's allow_jit guard
    seen = []
    real = triton_aot.launcher_source

    def spy(src, metadata):
        out = real(src, metadata)
        seen.append((src, dict(metadata), out))
        return out
    monkeypatch.setattr(triton_aot, "launcher_source", spy)
    triton_aot.build(tiny_plan(), tmp_path, *H200, log=lambda s: None)
    assert seen

    class Built(Exception):
        pass

    def intercept(src, **kw):
        raise Built(src)
    monkeypatch.setattr(driver, "compile_module_from_src", intercept)
    monkeypatch.setattr(driver, "library_dirs", lambda: [])
    for src, metadata, ours in seen:
        with pytest.raises(Built) as got:
            driver.CudaLauncher(src, types.SimpleNamespace(**metadata))
        assert got.value.args[0] == ours, getattr(src, "name", "?")


def test_the_engine_builds_the_cached_launchers_ahead_and_reports_them(tmp_path, monkeypatch):
    from triton import knobs
    from triton.runtime.cache import FileCacheManager
    monkeypatch.setattr(knobs.cache, "manager_class", FileCacheManager)  # an earlier test's allow_jit guard
    plan = tiny_plan()
    triton_aot.build(plan, tmp_path, *H200, log=lambda s: None)
    manifest = json.loads((tmp_path / "triton" / "manifest.json").read_text())
    names = manifest["launchers"]
    assert len(names) >= 2  # one per argument-type list of the kernels
    sources = {n: (tmp_path / "triton" / "launchers" / n).read_text() for n in names}
    assert all("PyInit___triton_launcher" in src for src in sources.values())
    built = []

    def fake_build(src, module):
        if src == sources[names[0]]:
            raise RuntimeError("no C compiler")
        built.append((module, src))
    monkeypatch.setattr(triton_cache, "build_launcher", fake_build)
    monkeypatch.setattr(knobs.cache, "dir", knobs.cache.dir)
    saved = dict(triton_cache._state)
    try:
        summary = triton_cache.use_triton_cache(tmp_path, plan.triton_fingerprint(H200[1]), allow_jit=True)
        assert summary["launchers"] == len(names) + 1  # and the driver's utility module
        report = triton_cache.wait_launchers()
        assert report["built"] == len(names) and report["failed"] == 1 and report["seconds"] >= 0
        launchers = sorted(src for module, src in built if module == "__triton_launcher")
        assert launchers == sorted(sources[n] for n in names[1:])
        assert [module for module, _ in built if module != "__triton_launcher"] == ["cuda_utils"]
        assert f"{len(names)} host modules (launchers) built ahead" in triton_cache.triton_summary()
        assert "1 left to first use" in triton_cache.triton_summary()
    finally:
        triton_cache._state.clear()
        triton_cache._state.update(saved)


@pytest.mark.gpu
def test_gpu_first_kernel_loads_find_the_launchers_built_ahead(tmp_path, monkeypatch):
    """On the GPU: the launchers built from the cache's sources are the ones the first kernel loads look up, so
    running the MoE layer at every step size compiles neither a kernel nor a launcher."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from triton import knobs
    from triton.runtime import build as triton_build
    from triton.runtime.cache import FileCacheManager
    monkeypatch.setattr(knobs.cache, "manager_class", FileCacheManager)
    monkeypatch.setattr(knobs.cache, "dir", knobs.cache.dir)
    capability = torch.cuda.get_device_capability()
    plan = tiny_plan()
    triton_aot.build(plan, tmp_path, capability, H200[1], log=lambda s: None)
    saved = dict(triton_cache._state)
    try:
        summary = triton_cache.use_triton_cache(tmp_path, plan.triton_fingerprint(H200[1]), allow_jit=False)
        report = triton_cache.wait_launchers()
        assert summary["launchers"] >= 3 and report == {"built": summary["launchers"], "failed": 0,
                                                        "seconds": report["seconds"]}
        builds = []
        real = triton_build._build
        monkeypatch.setattr(triton_build, "_build", lambda *a, **kw: (builds.append(a[0]), real(*a, **kw))[1])
        loaded = len(triton_cache.triton_events())
        layer = triton_aot.meta_moe_layer(plan, device=torch.device("cuda"))
        with torch.no_grad(), triton_aot.tuned_tables_for(H200[1]), pdl.enabled_as(plan.pdl_max_tokens):
            for p in layer.parameters():
                p.normal_(0.0, 0.02)
            for t in range(1, plan.max_step_tokens + 1):
                layer(torch.randn((t, plan.arch.hidden_size), dtype=plan.dtype, device="cuda"))
        torch.cuda.synchronize()
        events = triton_cache.triton_events()[loaded:]
        assert events and not any(e["compiled"] for e in events)
        assert builds == [], builds  # every launcher came from Triton's cache
    finally:
        triton_cache._state.clear()
        triton_cache._state.update(saved)

