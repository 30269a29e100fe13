"""Where a model prefetches weights into L2 (``l2_prefetch``): each layer's start names its own output projection
and shared-expert projections, the routed block the down projections of the experts it chose and the next
layer's QKV projection, every layer joins the prefetch stream before it ends, and steps of more than
``l2_prefetch_max_tokens`` tokens prefetch nothing. CPU, float32: the prefetcher records instead of launching
(the kernel itself is tested on the GPU, ``tests/ops/test_gpu_l2_prefetch.py``)."""
import torch

from hf_models import make_checkpoint
from moeserve import LLM, SamplingParams
from moeserve.models.layers import SparseMoE
from moeserve.ops.l2_prefetch import TARGETS, L2Prefetch


class Recorder(L2Prefetch):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    def _launch(self, w, ids):
        self.calls.append((w, ids))

    def join(self):
        self.calls.append("join")


def test_each_layer_prefetches_its_targets_and_joins(tmp_path):
    make_checkpoint("qwen2_moe", tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=32)
    model = llm.engine.runner.model
    layers = list(model.layers)
    moe = [isinstance(layer.mlp, SparseMoE) for layer in layers]
    assert len(layers) >= 2 and moe[0]
    assert all(layer.mlp.shared_expert is not None for layer, m in zip(layers, moe) if m)
    rec = Recorder(torch.device("cpu"), TARGETS, max_tokens=4)
    model.ops.prefetch = rec
    try:
        llm.generate([{"prompt_token_ids": [5, 9, 31]}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # steps of 3, 1
        steps = 2
        expected = []
        for i, layer in enumerate(layers):  # a dense layer (Qwen2-MoE's mlp_only_layers) has only its o_proj
            expected.append(layer.self_attn.o_proj.weight)
            if moe[i]:
                shared = layer.mlp.shared_expert
                expected += [shared.gate_up_proj.weight, shared.down_proj.weight, layer.mlp.w2]
                expected += [layers[i + 1].self_attn.qkv_proj.weight] if i + 1 < len(layers) else []
            expected.append("join")
        got = [c if c == "join" else c[0] for c in rec.calls]
        assert len(got) == steps * len(expected)
        assert all(a is b for a, b in zip(got, expected * steps))
        by_id = [c[1] for c in rec.calls if c != "join" and c[1] is not None]
        assert len(by_id) == steps * sum(moe)  # only the experts' rows go by id: the ids the router chose
        assert [tuple(ids.shape) for ids in by_id[:sum(moe)]] == [(3, model.arch.top_k)] * sum(moe)
        assert all(ids.dtype in (torch.int32, torch.int64) and 0 <= int(ids.min()) and
                   int(ids.max()) < model.arch.num_experts for ids in by_id)

        rec.calls.clear()
        llm.generate([{"prompt_token_ids": list(range(10, 20))}], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        assert rec.calls == ["join"] * len(layers)  # a step of 10 tokens: nothing prefetched
    finally:
        model.ops.prefetch = None
