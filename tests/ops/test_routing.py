"""Routing on hand-made cases: the chosen experts and weights are computed by hand in each test."""
import math

import torch

from moeserve.ops.moe.routing import RoutingConfig, deepseek_v3_topk, llama4_topk, select_experts, softmax_topk


def test_softmax_topk_without_renormalisation():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(4.0), math.log(1.0)]])  # probs 1/8, 2/8, 4/8, 1/8
    w, ids = softmax_topk(logits, 2, renormalize=False)
    assert ids.tolist() == [[2, 1]] and ids.dtype == torch.int32
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.25]]))


def test_softmax_topk_renormalised():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(4.0), math.log(1.0)]])
    w, ids = softmax_topk(logits, 2, renormalize=True)
    assert ids.tolist() == [[2, 1]]
    torch.testing.assert_close(w, torch.tensor([[2 / 3, 1 / 3]]))
    assert w.dtype == torch.float32


def test_deepseek_v3_group_limited_topk():
    # 8 experts in 4 groups of 2; sigmoid scores s; bias shifts the choice but not the weights.
    s = torch.tensor([[0.9, 0.1, 0.2, 0.3, 0.8, 0.7, 0.4, 0.35]])
    logits = torch.log(s / (1 - s))
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0])
    # biased: [0.9,0.1 | 0.2,0.3 | 0.8,0.7 | 0.9,0.35]; group scores (sum of top-2): 1.0, 0.5, 1.5, 1.25
    # top-2 groups: 2 and 3 -> candidates 4,5,6,7 with biased 0.8,0.7,0.9,0.35 -> top-3: 6, 4, 5
    w, ids = deepseek_v3_topk(logits, bias, top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert sorted(ids[0].tolist()) == [4, 5, 6]
    assert ids[0, 0].item() == 6
    unbiased = {4: 0.8, 5: 0.7, 6: 0.4}
    total = sum(unbiased.values())
    expect = torch.tensor([[unbiased[i] / total * 2.5 for i in ids[0].tolist()]])
    torch.testing.assert_close(w, expect, rtol=1e-5, atol=1e-6)
    # expert 0 has the best score but its group lost: it must not be chosen
    assert 0 not in ids[0].tolist()


def test_deepseek_v3_single_group_is_plain_topk_on_biased_scores():
    s = torch.tensor([[0.5, 0.6, 0.7]])
    logits = torch.log(s / (1 - s))
    bias = torch.tensor([0.3, 0.0, 0.0])
    w, ids = deepseek_v3_topk(logits, bias, top_k=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                              renormalize=False)
    assert ids.tolist() == [[0]]  # 0.5 + 0.3 beats 0.7
    torch.testing.assert_close(w, torch.tensor([[0.5]]))


def test_llama4_sigmoid_of_top_logit():
    logits = torch.tensor([[1.0, 3.0, -2.0], [0.5, -1.0, 2.0]])
    w, ids = llama4_topk(logits, 1)
    assert ids.tolist() == [[1], [2]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[3.0], [2.0]])))


def test_select_experts_dispatch():
    logits = torch.randn(5, 16)
    for cfg in (RoutingConfig("softmax", 4, True), RoutingConfig("deepseek_v3", 4, True, 4, 2, 1.5),
                RoutingConfig("llama4", 1)):
        w, ids = select_experts(logits, cfg, torch.zeros(16))
        assert w.shape == ids.shape == (5, cfg.top_k)
        assert ((ids >= 0) & (ids < 16)).all()
        # each token picks distinct experts
        assert all(len(set(r)) == cfg.top_k for r in ids.tolist())
