"""The L2 weight prefetch (``moeserve.ops.l2_prefetch``) on the GPU: the kernel takes any size and any ids
without faulting or writing, and a model that prefetches (every target, inside its decode CUDA graphs) gives the
logits of one that does not: a prefetch only moves lines into L2."""
import pytest
import torch

from hf_models import make_checkpoint
from lockstep import lockstep

pytestmark = pytest.mark.gpu

GPU_QWEN2 = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=128,
                 intermediate_size=256, shared_expert_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
                 vocab_size=512, initializer_range=0.05)


def engine(path, backends, **options):
    from moeserve.config import make_config
    from moeserve.engine.engine import LLMEngine
    return LLMEngine(make_config(model=str(path), dtype="bfloat16", device="cuda", backends=backends, page_size=16,
                                 max_num_batched_tokens=96, num_kv_pages=48, max_model_len=384, max_num_seqs=8,
                                 cuda_graph_batch_sizes=[1, 2, 4, 8], **options))


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not _sm90(), reason="cp.async.bulk.prefetch needs compute capability 9.0")
@pytest.mark.parametrize("evict_last", [False, True])
def test_prefetch_kernel_takes_any_size_and_ids_and_writes_nothing(evict_last):
    from moeserve.ops.l2_prefetch import launch_prefetch
    g = torch.Generator(device="cuda").manual_seed(3)
    for shape in [(1,), (37, 13), (4096, 2048), (3, 1000, 7)]:
        w = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
        before = w.clone()
        launch_prefetch(w, None, evict_last)
        torch.cuda.synchronize()
        assert torch.equal(w, before)
    w2 = torch.randn((16, 64, 48), generator=g, device="cuda").to(torch.bfloat16)
    before = w2.clone()
    for ids in [torch.tensor([[0, 15, 3, 3]], device="cuda", dtype=torch.int32),
                torch.tensor([-1, 16, 1 << 20, 7], device="cuda", dtype=torch.int32),  # no such rows: skipped
                torch.randint(0, 16, (64, 8), device="cuda", generator=g)]:  # int64 ids
        launch_prefetch(w2, ids, evict_last)
    torch.cuda.synchronize()
    assert torch.equal(w2, before)


@pytest.mark.skipif(not _sm90(), reason="cp.async.bulk.prefetch needs compute capability 9.0")
def test_model_with_l2_prefetch_matches_model_without(tmp_path):
    """Qwen2-MoE (shared expert) prefetching every target in its decode CUDA graphs and eager steps of up to 8
    tokens gives the logits and greedy tokens of the same engine without prefetch."""
    make_checkpoint("qwen2_moe", tmp_path, seed=7, **GPU_QWEN2)
    fast = {k: "flashinfer" for k in ("attention", "norm", "rope", "activation", "sampling")}
    targets = ["o_proj", "shared_down", "shared_gate_up", "expert_down", "next_qkv"]
    pf = engine(tmp_path, {**fast, "moe": "triton"}, l2_prefetch=targets, l2_prefetch_max_tokens=8)
    plain = engine(tmp_path, {**fast, "moe": "triton"})
    assert pf.runner.ops.prefetch is not None and plain.runner.ops.prefetch is None
    assert pf.runner.ops.prefetch.targets == frozenset(targets)
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 40, 3, 17, 66, 1)]
    r = lockstep(pf, plain, prompts, 10, follow="fast")
    assert r.graph_steps > 0
    assert r.worst > 0.99999 and r.agreement == 1.0
