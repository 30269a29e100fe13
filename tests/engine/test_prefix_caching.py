"""Prefix caching: requests reuse the KV pages of prompt prefixes already computed, and nothing else changes.

Whole-engine checks on small random checkpoints in float32: greedy tokens with caching on equal caching off
and transformers, for repeated and partially shared prompts, when cached pages are evicted mid-run and when a
request running on cached pages is preempted; ``num_cached_tokens`` is the exact count of full cached pages'
tokens; the page pool ends full. Unit checks of the chained page hash and of the eviction order.
"""
import pytest
import torch

from hf_models import hf_greedy, make_checkpoint
from moeserve import LLM, SamplingParams
from moeserve.engine.kv_cache import KVCacheManager, page_hash

PS = 4  # page size of every engine here
BASE = list(range(30, 50))  # 20 tokens: 5 full pages shared by the prompts below
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompts():
    return {
        "a": BASE + [7, 8, 9, 10, 11],  # 25 tokens
        "b": BASE + [90, 91, 92, 93, 94, 95, 96],  # shares 5 pages with a
        "a-again": BASE + [7, 8, 9, 10, 11],
        "half": BASE[:10] + [60, 61, 62],  # shares 2 full pages (8 tokens) with a
    }


def make_llm(path, caching: bool, **kw) -> LLM:
    opts = dict(dtype="float32", device="cpu", page_size=PS, max_model_len=128, max_num_seqs=4,
                max_num_batched_tokens=64, enable_prefix_caching=caching, seed=0)
    return LLM(model=str(path), **{**opts, **kw})


def one_by_one(llm, ps: dict, params=GREEDY) -> dict:
    out = {}
    for name, p in ps.items():
        r = llm.generate({"prompt_token_ids": p}, params)[0]
        out[name] = (r.outputs[0].token_ids, r.num_cached_tokens)
    return out


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_cached_prefixes_give_the_tokens_of_recompute_and_of_transformers(tmp_path, kind):
    hf = make_checkpoint(kind, tmp_path, seed=2)
    on, off = make_llm(tmp_path, True), make_llm(tmp_path, False)
    got, want = one_by_one(on, prompts()), one_by_one(off, prompts())
    for name, p in prompts().items():
        assert got[name][0] == want[name][0] == hf_greedy(hf, p, GREEDY.max_tokens), name
        assert want[name][1] == 0
    # a: nothing cached yet; b: a's 5 prompt pages; a-again: a's 6 full prompt pages (24 of 25 tokens, one
    # is always computed); half: 2 pages
    assert {n: c for n, (_, c) in got.items()} == {"a": 0, "b": 20, "a-again": 24, "half": 8}
    stats = on.engine.prefix_cache_stats()
    assert stats["queries"] == sum(len(p) for p in prompts().values()) and stats["hits"] == 20 + 24 + 8
    for llm in (on, off):
        assert llm.engine.pool.num_free == llm.engine.pool.capacity


def test_batched_requests_share_and_a_cache_salt_keeps_them_apart(tmp_path):
    make_checkpoint("qwen3_moe", tmp_path, seed=3)
    llm = make_llm(tmp_path, True)
    first = llm.generate({"prompt_token_ids": prompts()["a"]}, GREEDY)[0]
    batch = llm.generate([{"prompt_token_ids": prompts()["b"]}, {"prompt_token_ids": prompts()["b"], "cache_salt": "x"},
                          {"prompt_token_ids": prompts()["a"], "cache_salt": "x"}], GREEDY)
    assert [r.num_cached_tokens for r in batch] == [20, 0, 0]  # a salted request sees no unsalted page
    assert batch[0].outputs[0].token_ids == batch[1].outputs[0].token_ids
    assert batch[2].outputs[0].token_ids == first.outputs[0].token_ids
    again = llm.generate({"prompt_token_ids": prompts()["a"], "cache_salt": "x"}, GREEDY)[0]
    assert again.num_cached_tokens == 24  # the salted copy is cached under its own salt


def test_eviction_mid_run_and_preemption_of_a_cached_request(tmp_path):
    """A pool of 24 usable pages: cached pages are evicted while requests run, and the batch preempts; every
    request still gets exactly the tokens of a roomy engine without caching."""
    make_checkpoint("qwen2_moe", tmp_path, seed=4)
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 256, (16,), generator=g).tolist()
    many = [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 14, 6, 11, 2)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    roomy = make_llm(tmp_path, False)
    want = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in many], params)]
    tight = make_llm(tmp_path, True, num_kv_pages=25, max_model_len=64)
    warm = tight.generate([{"prompt_token_ids": p} for p in many[:2]], params)  # fills the cache
    assert [o.outputs[0].token_ids for o in warm] == want[:2]
    got = tight.generate([{"prompt_token_ids": p} for p in many], params)
    assert [o.outputs[0].token_ids for o in got] == want
    assert all(o.num_cached_tokens >= 16 for o in got)  # the shared prefix (4 pages) at least
    assert sum(o.metrics.num_preemptions for o in got) > 0, "the pool was meant to preempt"
    pool = tight.engine.pool
    assert pool.evictions > 0, "cached pages were meant to be overwritten while requests ran"
    assert pool.num_free == pool.capacity


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_caching_with_async_scheduling_chunked_prefill_and_seeds(tmp_path, async_scheduling):
    make_checkpoint("qwen3_moe", tmp_path, seed=5)
    ps = list(prompts().values())
    params = [GREEDY, SamplingParams(temperature=1.0, top_k=20, seed=9, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True), GREEDY]
    base = make_llm(tmp_path, False, async_scheduling=False, max_num_batched_tokens=16)
    want = [base.generate({"prompt_token_ids": p}, sp)[0].outputs[0].token_ids for p, sp in zip(ps, params)]
    llm = make_llm(tmp_path, True, async_scheduling=async_scheduling, max_num_batched_tokens=16)
    got = [llm.generate({"prompt_token_ids": p}, sp)[0] for p, sp in zip(ps, params)]
    assert [o.outputs[0].token_ids for o in got] == want
    assert [o.num_cached_tokens for o in got] == [0, 20, 24, 8]
    assert llm.engine.pool.num_free == llm.engine.pool.capacity


def test_page_hash_chains_parent_tokens_and_extra_key():
    a = page_hash(None, [1, 2, 3, 4])
    assert a == page_hash(None, [1, 2, 3, 4]) and len(a) == 32
    assert page_hash(None, [1, 2, 3, 5]) != a
    assert page_hash(a, [5, 6, 7, 8]) != page_hash(page_hash(None, [9, 9, 9, 9]), [5, 6, 7, 8])  # the parent
    assert page_hash(None, [1, 2, 3, 4], "salt") != a and page_hash(None, [1, 2, 3, 4], "salt") != page_hash(
        None, [1, 2, 3, 4], "other")


def test_freed_cached_pages_are_reused_oldest_first_and_tail_first():
    m = KVCacheManager(9, 2)  # 8 usable pages
    hs = [page_hash(None, [i, i]) for i in range(8)]
    first = m.allocate(3)
    m.register(first, hs[:3], 0)
    m.free(first)  # freed tail first: first[2], first[1], first[0] join the free queue in that order
    assert m.num_free == 8 and m.num_cached == 3 and m.match(hs[:3], 3) == first
    fresh = m.allocate(5)  # the 5 never-used pages come before any cached one
    assert not set(fresh) & set(first) and m.match(hs[:3], 3) == first
    m.allocate(1)  # the oldest free page now: the tail of ``first`` -- its hash is forgotten
    assert m.match(hs[:3], 3) == first[:2] and m.num_cached == 2 and m.evictions == 1
    taken = m.match(hs[:2], 2)
    assert m.free_after_taking(taken) == 0
    m.take(taken)
    assert m.num_free == 0
    with pytest.raises(RuntimeError, match="freed twice"):
        m.free([first[2], first[2]])


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt(tmp_path):
    """Prompt log-probabilities are not cached: such a request skips the cache (as vLLM's), and gets every
    prompt position scored, the same as without caching."""
    make_checkpoint("qwen3_moe", tmp_path, seed=8)
    on, off = make_llm(tmp_path, True), make_llm(tmp_path, False)
    p = prompts()["a"]
    on.generate({"prompt_token_ids": p}, GREEDY)  # cache the prompt
    scored = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    got, want = on.generate({"prompt_token_ids": p}, scored)[0], off.generate({"prompt_token_ids": p}, scored)[0]
    assert got.num_cached_tokens == 0 and len(got.prompt_logprobs) == len(p) and got.prompt_logprobs[0] is None
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert set(a) == set(b) and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    assert on.generate({"prompt_token_ids": p}, GREEDY)[0].num_cached_tokens == 24  # others still hit
