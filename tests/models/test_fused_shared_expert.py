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
    with pytest.raises(ValueError, match="moe_fuse_shared_expert_pieces: set moe_fuse_shared_expert: true"):
        _engine(tmp_path, False, device="cpu", moe_fuse_shared_expert_pieces=2)


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("pieces", [0, 1])
def test_fused_shared_expert_on_the_gpu_follows_the_unfused_engine(tmp_path, pieces):
    """The Triton router appends the gated shared columns, the Triton MoE runs E + 2 experts (one-token steps
    pairwise, larger ones aligned), CUDA graphs on (bfloat16: FlashInfer's attention); against the unfused
    engine on the same backends. ``pieces`` 1: one of the two pieces joins, the other half of the shared expert
    runs apart on the side stream, gated by the router's column. A small KV cache each, so the two engines leave
    the GPU to later tests."""
    from moeserve.config import make_config
    from moeserve.engine.engine import LLMEngine
    make_checkpoint("qwen2_moe", tmp_path, seed=1, hidden_size=512, num_attention_heads=4, num_key_value_heads=4,
                    moe_intermediate_size=128, intermediate_size=256, shared_expert_intermediate_size=256,
                    num_experts=16, num_experts_per_tok=4, vocab_size=512, initializer_range=0.05)

    def engine(fused: bool):
        return LLMEngine(make_config(model=str(tmp_path), dtype="bfloat16", device="cuda", page_size=16,
                                     max_num_batched_tokens=96, num_kv_pages=48, max_model_len=384, max_num_seqs=8,
                                     cuda_graph_batch_sizes=[1, 2, 4, 8], moe_fuse_shared_expert=fused,
                                     moe_fuse_shared_expert_pieces=pieces))
    fast, ref = engine(True), engine(False)
    block = fast.runner.model.moe_blocks()[0]
    assert fast.runner.backend_names["moe"] == "triton" and block.router is not None and block.router.appends_shared
    if pieces:
        assert block.fused_shared == 1 and block.shared_expert.intermediate == 128
    else:
        assert block.fused_shared == 2 and block.shared_expert is None
    assert fast.runner.graphs is not None
    prompts = [[5, 9, 31, 77, 120, 3], [200, 17, 4], list(range(40, 61))]
    r = lockstep(fast, ref, prompts, 8, follow="fast")
    # bfloat16: the shared expert's down projection is summed in two pieces, in another order
    assert r.graph_steps > 0 and r.worst > 0.999 and r.agreement >= 0.95, (r.agreement, r.worst, r.graph_steps)
