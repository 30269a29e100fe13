"""Page pool and scheduler: budgets, chunking, mixed steps, max_num_seqs, preemption, pool back to full."""
import pytest

from moeserve.engine.kv_cache import KVCacheManager as PagePool
from moeserve.engine.kv_cache import OutOfPages
from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.scheduler import Scheduler
from moeserve.engine.sequence import Sequence


def seq(i, n_prompt, max_tokens=4):
    return Sequence(f"r{i}", list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_to_end(sched, token=7, max_steps=1000, log=None):
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return steps
        out = sched.schedule()
        assert out.items, "scheduler stalled with work left"
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        steps.append(out)
        if log is not None:
            log.extend((it.seq.request_id, it.start, it.num_tokens, it.seq.num_tokens) for it in out.items)
        sched.update(out, [token if it.samples else None for it in out.items])
    raise AssertionError("did not finish")


def test_page_pool_allocates_and_frees():
    pool = PagePool(9, 4)
    assert pool.capacity == 8 and pool.num_free == 8
    a = pool.allocate(5)
    assert 0 not in a and len(set(a)) == 5  # page 0 is reserved
    with pytest.raises(OutOfPages):
        pool.allocate(4)
    pool.free(a)
    assert pool.num_free == 8
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(a[:1])
    assert pool.pages_for(9) == 3


def test_chunked_prefill_and_mixed_steps():
    pool = PagePool(64, 4)
    s = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq(0, 6, max_tokens=5), seq(1, 23, max_tokens=3)
    s.add(a)
    s.add(b)
    steps = run_to_end(s)
    first = steps[0]
    assert [(it.seq.request_id, it.num_tokens) for it in first.items] == [("r0", 6), ("r1", 4)]
    assert not first.items[1].samples  # a chunk, not the end of the prompt
    # later steps decode r0 while r1's prompt is still being prefilled in chunks
    mixed = [o for o in steps if any(it.num_tokens == 1 and it.start > 0 for it in o.items)
             and any(it.num_tokens > 1 for it in o.items)]
    assert mixed
    assert a.output_token_ids == [7] * 5 and b.output_token_ids == [7] * 3
    assert a.finish_reason == b.finish_reason == "length"
    assert pool.num_free == pool.capacity


def test_max_num_seqs_limits_running():
    pool = PagePool(64, 4)
    s = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [seq(i, 3, max_tokens=2 + i) for i in range(5)]
    for x in seqs:
        s.add(x)
    out = s.schedule()
    assert len(out.items) == 2 and len(s.waiting) == 3
    s.update(out, [7, 7])
    run_to_end(s)
    # requests finish at different times; each got exactly its own max_tokens
    assert [len(x.output_token_ids) for x in seqs] == [2, 3, 4, 5, 6]
    assert pool.num_free == pool.capacity


def test_preemption_frees_pages_and_recomputes():
    pool = PagePool(7, 4, enable_caching=False)  # 6 usable pages = 24 tokens; recompute everything
    s = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(0, 8, max_tokens=8), seq(1, 8, max_tokens=8)  # each needs 16 tokens = 4 pages at the end
    s.add(a)
    s.add(b)
    log = []
    steps = run_to_end(s, log=log)
    assert s.num_preemptions >= 1
    assert b.num_preemptions >= 1 and a.num_preemptions == 0  # the later arrival is the victim
    pre = next(o for o in steps if o.preempted)
    assert pre.preempted[0] is b
    # after preemption b's whole sequence (prompt + the tokens it had) is fed again from position 0
    restarts = [(start, n, total) for rid, start, n, total in log if rid == "r1" and start == 0]
    assert len(restarts) >= 2
    _, n, total = restarts[-1]
    assert n == total > b.num_prompt_tokens
    assert len(a.output_token_ids) == len(b.output_token_ids) == 8
    assert pool.num_free == pool.capacity


def test_abort_returns_pages():
    pool = PagePool(16, 4)
    s = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(0, 10), seq(1, 10)
    s.add(a)
    s.add(b)
    out = s.schedule()
    s.update(out, [7, 7])
    assert pool.num_free < pool.capacity
    s.abort(a)
    s.abort(b)
    assert a.finish_reason == "abort" and pool.num_free == pool.capacity and not s.has_unfinished()


def test_batch_builder_marks_only_sampling_rows():
    """A one-token prompt chunk that does not finish its prompt must not produce logits."""
    import torch

    from moeserve.engine.batch import BatchBuilder
    from moeserve.engine.scheduler import ScheduledSeq
    pool = PagePool(32, 4)
    a, b = seq(0, 9), seq(1, 3)
    for s in (a, b):
        s.pages = pool.allocate(pool.pages_for(s.num_tokens))
    b.output_token_ids = [5]
    items = [ScheduledSeq(a, 4, 1).request(), ScheduledSeq(b, 3, 1).request()]  # a: chunk of its prompt; b: a decode
    batch = BatchBuilder(4, 64, 8, 64, torch.device("cpu")).build(items)
    assert batch.logits_indices.tolist() == [1]
    assert batch.input_ids.tolist() == [5, 5] and batch.positions.tolist() == [4, 3]
    assert not batch.attn.is_decode or all(i.start > 0 for i in items)
    assert batch.attn.slot_mapping.tolist() == [a.pages[1] * 4 + 0, b.pages[0] * 4 + 3]
    assert batch.attn.kv_last_page_len.tolist() == [1, 4]


def test_a_preempted_request_comes_back_on_its_cached_pages():
    """With prefix caching, the victim's full pages stay cached after preemption: it is re-admitted at the
    end of its cached full pages (here all of its computed tokens) instead of position 0."""
    pool = PagePool(7, 4)
    s = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(0, 8, max_tokens=8), seq(1, 8, max_tokens=8)
    s.add(a)
    s.add(b)
    seen, resumed = [], None
    while s.has_unfinished():
        out = s.schedule()
        if out.preempted:
            assert out.preempted == [b]
            computed = seen[-1][0] + seen[-1][1]  # b's tokens in the cache when it was preempted
        for it in out.items:
            if it.seq is b:
                if b.num_preemptions and resumed is None:
                    resumed = it.start
                seen.append((it.start, it.num_tokens))
        s.update(out, [7 if it.samples else None for it in out.items])
    assert b.num_preemptions == 1 and resumed == computed // 4 * 4 > 0
    assert len(a.output_token_ids) == len(b.output_token_ids) == 8
    assert pool.num_free == pool.capacity and pool.queries == 16 and pool.hits == 0  # hits: first admissions only
