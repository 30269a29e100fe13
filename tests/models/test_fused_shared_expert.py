"""The shared expert run inside the fused MoE (``moe_fuse_shared_expert``): its intermediate rows cut into
pieces of the routed experts' size (the last zero-padded), chosen for every token with the shared expert's
gate as weight. It must compute the same MoE block and the same model as the shared expert run apart.

CPU: float32, torch backends, a Qwen2-MoE checkpoint (gated shared expert of 80 rows over experts of 32: three
pieces, 16 rows of padding) and a GLM-4.5 one (ungated shared expert, DeepSeek routing). GPU (``-m gpu``): the
Triton router writing the shared columns and the fused MoE kernel, in bfloat16 with CUDA graphs, against the
unfused engine.
"""
import pytest
import torch

from hf_models import make_checkpoint
from lockstep import lockstep
from moeserve import LLM

COS_FP32 = 0.99999  # float32: the pieces change only the order of the down projection's sums


def _engine(path, fused: bool, **kw):
    """``fused``: every step runs the shared expert in the fused MoE; otherwise the steps of at most
    ``moe_fuse_shared_expert_max_tokens`` tokens (0, none, unless given)."""
    kw.setdefault("moe_fuse_shared_expert_max_tokens", 0)
    return LLM(model=str(path), dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
               moe_fuse_shared_expert=fused, **kw).engine


@pytest.mark.parametrize("kind,pieces", [("qwen2_moe", 3), ("glm4_moe", 1)])
def test_a_fused_block_computes_the_unfused_block(tmp_path, kind, pieces):
    make_checkpoint(kind, tmp_path)
    plain, fused = _engine(tmp_path, False, device="cpu"), _engine(tmp_path, True, device="cpu")
    a, b = plain.runner.model.moe_blocks()[0], fused.runner.model.moe_blocks()[0]
    assert a.fused_shared == 0 and a.shared_expert is not None
    assert b.fused_shared == pieces and b.shared_expert is None
    assert b.w13.shape[0] == a.w13.shape[0] + pieces and b.w2.shape[0] == a.w2.shape[0] + pieces
    x = torch.randn(9, a.w13.shape[2], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        w, ids, _ = b.route(x)
        assert ids.shape[1] == a.top_k + pieces
        assert torch.equal(ids[:, a.top_k:], torch.arange(a.num_experts, a.num_experts + pieces).expand(9, -1).to(ids))
        torch.testing.assert_close(b(x), a(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pieces", [1, 2])
def test_a_partly_fused_block_computes_the_unfused_block(tmp_path, pieces):
    """``moe_fuse_shared_expert_pieces``: the first pieces of the shared expert join the routed experts, its other
    rows stay a smaller shared expert (gated as before); the block's output is the same."""
    make_checkpoint("qwen2_moe", tmp_path)  # a gated shared expert of 80 rows over experts of 32
    plain = _engine(tmp_path, False, device="cpu")
    part = _engine(tmp_path, True, device="cpu", moe_fuse_shared_expert_pieces=pieces)
    a, b = plain.runner.model.moe_blocks()[0], part.runner.model.moe_blocks()[0]
    assert b.fused_shared == pieces and b.w13.shape[0] == a.w13.shape[0] + pieces
    assert b.shared_expert is not None and b.shared_expert.intermediate == 80 - 32 * pieces
    torch.testing.assert_close(b.shared_expert.down_proj.weight, a.shared_expert.down_proj.weight[:, 32 * pieces:])
    x = torch.randn(9, a.w13.shape[2], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        w, ids, gate = b.route(x)
        assert ids.shape[1] == a.top_k + pieces and gate is not None  # the rows left apart keep their gate
        torch.testing.assert_close(b(x), a(x), rtol=1e-5, atol=1e-6)


def test_as_many_pieces_as_the_shared_expert_has_fuses_all_of_it(tmp_path):
    make_checkpoint("qwen2_moe", tmp_path)
    b = _engine(tmp_path, True, device="cpu", moe_fuse_shared_expert_pieces=5).runner.model.moe_blocks()[0]
    assert b.fused_shared == 3 and b.shared_expert is None


def test_a_fused_engine_follows_the_unfused_one(tmp_path):
    make_checkpoint("qwen2_moe", tmp_path)
    prompts = [[5, 9, 31, 77, 120, 3], [200, 17, 4], list(range(40, 61))]
    r = lockstep(_engine(tmp_path, True, device="cpu"), _engine(tmp_path, False, device="cpu"), prompts, 8)
    assert r.agreement == 1.0 and r.worst > COS_FP32, (r.agreement, r.worst)
    part = _engine(tmp_path, True, device="cpu", moe_fuse_shared_expert_pieces=2)
    r = lockstep(part, _engine(tmp_path, False, device="cpu"), prompts, 8)
    assert r.agreement == 1.0 and r.worst > COS_FP32, (r.agreement, r.worst)


def test_fusing_is_refused_by_name_where_it_cannot_apply(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path)
    with pytest.raises(ValueError, match="moe_fuse_shared_expert: the model has no shared expert"):
        _engine(tmp_path, True, device="cpu")
    with pytest.raises(ValueError, match="moe_fuse_shared_expert_pieces: set moe_fuse_shared_expert: true or "
                                         "moe_fuse_shared_expert_max_tokens above 0"):
        _engine(tmp_path, False, device="cpu", moe_fuse_shared_expert_pieces=2)
    # the default (small steps fused where it applies) passes over a model it does not apply to
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              device="cpu")
    assert llm.engine.runner.plan.fused_shared_expert_steps is None
    assert all(b.fused_shared == 0 for b in llm.engine.runner.model.moe_blocks())


@pytest.mark.parametrize("pieces,max_tokens", [(0, 1), (2, 4)])
def test_small_steps_fuse_the_shared_expert_and_larger_ones_run_it_apart(tmp_path, pieces, max_tokens):
    """``moe_fuse_shared_expert_max_tokens`` (default 1): steps of at most that many tokens take the shared expert
    in the fused MoE (all of it, or ``pieces`` of it with the rest apart), larger ones run the whole shared expert
    apart from its own weights, which stay as loaded; every step size computes the unfused block."""
    make_checkpoint("qwen2_moe", tmp_path)  # a gated shared expert of 80 rows over experts of 32: three pieces
    plain = _engine(tmp_path, False, device="cpu")
    kw = {"moe_fuse_shared_expert_pieces": pieces} if pieces else {}
    small = _engine(tmp_path, False, device="cpu", moe_fuse_shared_expert_max_tokens=max_tokens, **kw)
    assert small.runner.plan.fused_shared_expert_steps == max_tokens
    a, b = plain.runner.model.moe_blocks()[0], small.runner.model.moe_blocks()[0]
    n = pieces or 3
    assert b.fused_shared == n and b.fused_max_tokens == max_tokens and b.w13.shape[0] == a.w13.shape[0] + n
    assert b.shared_expert.intermediate == 80  # the whole shared expert, for the larger steps
    torch.testing.assert_close(b.shared_expert.down_proj.weight, a.shared_expert.down_proj.weight, rtol=0, atol=0)
    assert (b.fused_rest is None) == (not pieces)
    x = torch.randn(9, a.w13.shape[2], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for t in (1, max_tokens, max_tokens + 1, 9):
            w, ids, gate = b.route(x[:t])
            fused = t <= max_tokens
            assert ids.shape[1] == a.top_k + (n if fused else 0), t
            assert b.fuses_shared(t) == fused and (gate is None) == (fused and not pieces), t
            torch.testing.assert_close(b(x[:t]), a(x[:t]), rtol=1e-5, atol=1e-6)


def test_the_default_engine_follows_the_unfused_one(tmp_path):
    """One request decodes in one-token steps, fused by default; three decode in steps of three, which
    ``moe_fuse_shared_expert_max_tokens: 4`` fuses and whose prefill it does not."""
    make_checkpoint("qwen2_moe", tmp_path)
    default = LLM(model=str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                  device="cpu").engine
    assert default.runner.plan.fused_shared_expert_steps == 1
    r = lockstep(default, _engine(tmp_path, False, device="cpu"), [[5, 9, 31, 77, 120, 3]], 8)
    assert r.agreement == 1.0 and r.worst > COS_FP32, (r.agreement, r.worst)
    prompts = [[5, 9, 31, 77, 120, 3], [200, 17, 4], list(range(40, 61))]
    four = _engine(tmp_path, False, device="cpu", moe_fuse_shared_expert_max_tokens=4)
    r = lockstep(four, _engine(tmp_path, False, device="cpu"), prompts, 8)
    assert r.agreement == 1.0 and r.worst > COS_FP32, (r.agreement, r.worst)


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("pieces,max_tokens,in_grid", [(0, 0, False), (1, 0, False), (0, 4, False), (0, 4, True)],
                         ids=["all", "one-piece", "small-steps", "small-steps-route-in-grid"])
def test_fused_shared_expert_on_the_gpu_follows_the_unfused_engine(tmp_path, pieces, max_tokens, in_grid):
    """The Triton router appends the gated shared columns, the Triton MoE runs E + 2 experts (one-token steps
    pairwise, larger ones aligned), CUDA graphs on (bfloat16: FlashInfer's attention); against the unfused
    engine on the same backends. ``pieces`` 1: one of the two pieces joins, the other half of the shared expert
    runs apart on the side stream, gated by the router's column. ``max_tokens`` 4: only steps of at most 4 tokens
    (the decode graphs of 1, 2 and 4) fuse it, the graph of 8 and the prefill run it apart beside the routed
    experts, which the Triton MoE still reads from the tensor of E + 2. ``in_grid``: one-token steps route inside
    the fused MoE's first grid (``moe_route_in_grid``). A small KV cache each, so the two engines leave the GPU to
    later tests."""
    from moeserve.config import make_config
    from moeserve.engine.engine import LLMEngine
    make_checkpoint("qwen2_moe", tmp_path, seed=1, hidden_size=512, num_attention_heads=4, num_key_value_heads=4,
                    moe_intermediate_size=128, intermediate_size=256, shared_expert_intermediate_size=256,
                    num_experts=16, num_experts_per_tok=4, vocab_size=512, initializer_range=0.05)

    def engine(fused: bool):
        return LLMEngine(make_config(model=str(tmp_path), dtype="bfloat16", device="cuda", page_size=16,
                                     max_num_batched_tokens=96, num_kv_pages=48, max_model_len=384, max_num_seqs=8,
                                     cuda_graph_batch_sizes=[1, 2, 4, 8],
                                     moe_fuse_shared_expert=fused and not max_tokens,
                                     moe_fuse_shared_expert_max_tokens=max_tokens if fused else 0,
                                     moe_fuse_shared_expert_pieces=pieces if fused else 0,
                                     moe_route_in_grid=in_grid and fused))
    fast, ref = engine(True), engine(False)
    block = fast.runner.model.moe_blocks()[0]
    assert fast.runner.backend_names["moe"] == "triton" and block.router is not None and block.router.appends_shared
    assert ref.runner.model.moe_blocks()[0].fused_shared == 0
    if max_tokens:
        assert block.fused_shared == 2 and block.fused_max_tokens == 4 and block.shared_expert.intermediate == 256
    elif pieces:
        assert block.fused_shared == 1 and block.shared_expert.intermediate == 128
    else:
        assert block.fused_shared == 2 and block.shared_expert is None
    assert fast.runner.graphs is not None
    assert fast.runner.plan.moe_route_in_grid == in_grid
    if in_grid:
        x = torch.zeros(1, 512, dtype=torch.bfloat16, device="cuda")
        moe = fast.runner.ops.moe
        assert moe.takes_routing(x, block) and not moe.takes_routing(x.expand(2, -1), block)
    prompts = [[5, 9, 31, 77, 120, 3], [200, 17, 4], list(range(40, 61))]
    r = lockstep(fast, ref, prompts, 8, follow="fast")
    # bfloat16: the shared expert's down projection is summed in two pieces, in another order
    assert r.graph_steps > 0 and r.worst > 0.999 and r.agreement >= 0.95, (r.agreement, r.worst, r.graph_steps)
