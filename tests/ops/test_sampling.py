"""The torch sampler: each filter's support, distributions, and per-request seeds."""
import torch

from moeserve.ops.sampling import SamplingBatch, TorchSampler

N = 4000  # draws per distribution check; tolerances below are > 4 standard deviations


def batch(rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, keys=None):
    return SamplingBatch(
        temperature=torch.full((rows,), temperature), top_k=torch.full((rows,), top_k, dtype=torch.int32),
        top_p=torch.full((rows,), top_p), min_p=torch.full((rows,), min_p),
        greedy=[temperature == 0 or top_k == 1] * rows, seeds=seeds or [None] * rows, steps=[0] * rows,
        keys=keys or [f"r{i}" for i in range(rows)])


def draw(logits, **kw):
    s = TorchSampler(torch.device("cpu"), seed=0)
    rows = logits.expand(N, -1).contiguous()
    return s.sample(rows, batch(N, **kw))


LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def freq(tokens, v=4):
    return torch.bincount(tokens, minlength=v).float() / len(tokens)


def test_greedy_is_argmax():
    logits = torch.randn(6, 50)
    out = TorchSampler(torch.device("cpu")).sample(logits, batch(6, temperature=0.0))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_plain_sampling_follows_softmax():
    f = freq(draw(LOGITS))
    torch.testing.assert_close(f, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.035, rtol=0)


def test_temperature_flattens():
    f = freq(draw(LOGITS, temperature=2.0))
    expect = torch.softmax(LOGITS[0] / 2.0, -1)
    torch.testing.assert_close(f, expect, atol=0.035, rtol=0)


def test_top_k_support_and_renormalisation():
    f = freq(draw(LOGITS, top_k=2))
    assert f[2] == 0 and f[3] == 0
    torch.testing.assert_close(f[:2], torch.tensor([0.5, 0.3]) / 0.8, atol=0.035, rtol=0)


def test_top_p_keeps_smallest_prefix_reaching_p():
    f = freq(draw(LOGITS, top_p=0.7))  # 0.5 < 0.7 <= 0.8: tokens 0 and 1
    assert f[2] == 0 and f[3] == 0
    torch.testing.assert_close(f[:2], torch.tensor([0.5, 0.3]) / 0.8, atol=0.035, rtol=0)
    f = freq(draw(LOGITS, top_p=0.4))  # the top token alone already reaches 0.4
    assert f[0] == 1.0


def test_min_p_relative_to_top_probability():
    f = freq(draw(LOGITS, min_p=0.35))  # keeps p >= 0.175: tokens 0 and 1
    assert f[2] == 0 and f[3] == 0 and f[1] > 0.2


def test_filters_compose_in_order():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    f = freq(draw(logits, top_k=3, top_p=0.75))  # top-k 3 -> .444 .333 .222; top-p .75 -> tokens 0, 1
    assert f[2] == 0 and f[3] == 0


def test_seeded_streams_reproduce_and_belong_to_their_request():
    logits = torch.randn(3, 100)
    a = TorchSampler(torch.device("cpu")).sample(logits, batch(3, seeds=[1, 2, 3], keys=["a", "b", "c"]))
    s = TorchSampler(torch.device("cpu"))
    b = s.sample(logits, batch(3, seeds=[1, 2, 3], keys=["a", "b", "c"]))
    assert a.tolist() == b.tolist()
    # a row's draw depends only on its own request's stream, not on its neighbours
    c = TorchSampler(torch.device("cpu")).sample(logits[1:2], batch(1, seeds=[2], keys=["b"]))
    assert c.item() == a[1].item()
    # the sampler keeps each seeded request's stream across calls until it is released
    again = s.sample(logits, batch(3, seeds=[1, 2, 3], keys=["a", "b", "c"]))
    fresh = TorchSampler(torch.device("cpu"))
    fresh.sample(logits, batch(3, seeds=[1, 2, 3], keys=["a", "b", "c"]))
    assert again.tolist() == fresh.sample(logits, batch(3, seeds=[1, 2, 3], keys=["a", "b", "c"])).tolist()
    assert set(s._seeded) == {"a", "b", "c"}
    s.release(["a", "c"])
    assert set(s._seeded) == {"b"}
    restarted = s.sample(logits[:1], batch(1, seeds=[1], keys=["a"]))
    assert restarted.item() == a[0].item()  # a released key starts its stream from its seed again


def test_filter_flags_are_per_row_and_known_on_the_host():
    """A seeded row is sampled alone with the filters it uses itself (its random stream must not depend on
    its neighbours), from flags the engine knows without reading the GPU."""
    from moeserve import LLM, SamplingParams
    from moeserve.engine.scheduler import ScheduledSeq
    eng = LLM(model="tiny", max_num_seqs=4, max_model_len=64).engine
    rows = [SamplingParams(temperature=1.0, top_k=5, max_tokens=4),
            SamplingParams(temperature=1.0, min_p=0.1, max_tokens=4),
            SamplingParams(temperature=0.7, top_p=0.9, max_tokens=4)]
    seqs = [eng.add_request([1, 2, 3], p) for p in rows]
    b = eng.runner.sampling_batch([ScheduledSeq(s, 0, 3).request() for s in seqs])
    assert b.filters == [(True, False, False), (False, False, True), (False, True, False)]
    assert b.uses([0]) == (True, False, False) and b.uses([1]) == (False, False, True)
    assert b.uses([0, 2]) == (True, True, False)
    b.filters = None  # a batch made by hand: the flags come from the tensors
    assert b.uses([1]) == (False, False, True) and b.uses([0, 1, 2]) == (True, True, True)
