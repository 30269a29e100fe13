"""Continuous batching with a token budget, chunked prefill, mixed steps and preemption by recompute.

Every step the scheduler fills a budget of ``max_num_batched_tokens``: first the running requests in
arrival order (a decode costs one token; a prompt still being prefilled costs its next chunk), then
waiting requests while there is budget, room under ``max_num_seqs`` and free pages. A prompt longer than
the remaining budget is cut into chunks over several steps, so one step can hold prefill chunks and
decodes together. When a running request needs a page and none is free, the most recently arrived
running request is preempted: its pages are freed and it goes back to the front of the queue to be
recomputed from its tokens later. Its tokens so far are kept, so preemption never changes them.

Pages are the KV-cache manager's (``moeserve.engine.kv_cache``): with prefix caching a request admitted from
the queue first takes the cached pages its tokens start with and computes only the rest, and every full page
of computed tokens whose ids the host has is registered in the cache.

A step's life here has two halves: ``advance`` when it is launched (the fed tokens count as computed, and
each sampling request gets one in-flight token) and ``receive`` when its sampled tokens reach the host.
With asynchronous scheduling the next step is scheduled between the two, planning around the in-flight
tokens; a request whose in-flight token is already its last (``max_tokens``, ``max_model_len``) is not
scheduled again.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from moeserve.engine.kv_cache import KVCacheManager
from moeserve.engine.sequence import Sequence, Status
from moeserve.engine.step import ScheduledRequest, StepInput, is_decode


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already in the cache
    num_tokens: int  # tokens fed this step
    # True when this step computes the sequence's last pending token, so a new token is sampled (fixed when
    # the step is scheduled: the sequence grows while the step is in flight)
    samples: bool = field(init=False)

    def __post_init__(self):
        self.samples = self.start + self.num_tokens == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        return is_decode(self.start, self.num_tokens)

    def request(self) -> ScheduledRequest:
        """This part of the step as plain data (read when the step is scheduled, before ``advance``)."""
        s, start, end = self.seq, self.start, self.start + self.num_tokens
        ids = s.token_slice(start, min(end, s.num_resolved))
        inflight_row = -1
        if len(ids) < self.num_tokens:  # the last token is in flight (only ever one, and only the last)
            assert len(ids) == self.num_tokens - 1, f"{s!r}: more than one in-flight token in a step"
            ids = ids + [0]
            inflight_row = s.last_row
        req = ScheduledRequest(s.request_id, start, ids, list(s.pages), self.samples,
                               inflight_row, s.sampling_row() if self.samples else None)
        if s.prompt_logprobs_wanted(start, end):
            req.prompt_logprobs = s.params.prompt_logprobs
            req.next_prompt_token = s.prompt_token_ids[end] if end < s.num_prompt_tokens else None
        return req


@dataclass
class SchedulerOutput:
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    @property
    def is_decode(self) -> bool:
        return bool(self.items) and all(i.is_decode for i in self.items)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items if not i.is_decode)

    def step_input(self, step_id: int, finished_request_ids: list[str] | None = None) -> StepInput:
        return StepInput(step_id, [i.request() for i in self.items], list(finished_request_ids or []))


class Scheduler:
    def __init__(self, pool: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # --- queue ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"

    def _release(self, seq: Sequence) -> None:
        if seq.pages:
            self.pool.free(seq.pages)
            seq.pages = []
        seq.num_registered = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` the pages for ``num_tokens`` more tokens if they are free."""
        need = self.pool.pages_for(seq.num_computed + num_tokens) - len(seq.pages)
        if need > self.pool.num_free:
            return False
        if need > 0:
            seq.pages.extend(self.pool.allocate(need))
        return True

    # --- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.done_by_length:  # its last token is in flight; it finishes when that token arrives
                i += 1
                continue
            n = min(seq.num_pending, budget)
            while not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.items.append(ScheduledSeq(seq, seq.num_computed, n))
                budget -= n
                i += 1
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]  # no pages, nothing computed (new or preempted)
                cached = self._cached_prefix(seq)
                start = len(cached) * self.pool.page_size
                n = min(seq.num_tokens - start, budget)
                need = self.pool.pages_for(start + n) - len(cached)
                if need > self.pool.free_after_taking(cached):
                    break
                self.pool.take(cached)
                seq.pages = cached + self.pool.allocate(need)
                seq.num_computed, seq.num_registered = start, len(cached)
                self.waiting.popleft()
                seq.status = Status.RUNNING
                if seq.timing.first_scheduled is None:
                    seq.timing.first_scheduled = time.perf_counter()
                    seq.num_cached_tokens = start
                    self.pool.record_query(seq.num_prompt_tokens, start)
                self.running.append(seq)
                out.items.append(ScheduledSeq(seq, start, n))
                budget -= n
        return out

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached pages ``seq``'s tokens start with, leaving at least one token to compute. A request that
        wants prompt log-probabilities computes its whole prompt (they are not cached), as vLLM does."""
        scoring = seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens
        if not self.pool.enable_caching or scoring:
            return []
        ps = self.pool.page_size
        return self.pool.match(seq.full_page_hashes(ps), (seq.num_tokens - 1) // ps)

    def _register(self, seq: Sequence) -> None:
        """Make ``seq``'s full pages of computed tokens whose ids the host has findable in the cache."""
        if not self.pool.enable_caching:
            return
        ps = self.pool.page_size
        upto = min(seq.num_computed, seq.num_resolved) // ps
        if upto > seq.num_registered:
            self.pool.register(seq.pages, seq.full_page_hashes(ps)[:upto], seq.num_registered)
            seq.num_registered = upto

    def advance(self, out: SchedulerOutput) -> None:
        """The step of ``out`` is launched: its tokens count as computed; each sampling request has one more
        token in flight, at its row of the step's sampled tokens (sampling requests in step order)."""
        row = 0
        for item in out.items:
            item.seq.num_computed = item.start + item.num_tokens
            if item.samples:
                item.seq.num_inflight += 1
                item.seq.last_row = row
                row += 1
            self._register(item.seq)

    def receive(self, out: SchedulerOutput, sampled: list[int | None], now: float | None = None) -> list[Sequence]:
        """The tokens of the step of ``out`` arrive (``None`` where a request did not sample); returns the
        requests that got one. Requests finished or aborted while the step ran drop theirs."""
        now = now or time.perf_counter()
        got = []
        for item, token in zip(out.items, sampled):
            seq = item.seq
            if token is None or seq.is_finished:
                continue
            seq.receive_token(token, now)
            got.append(seq)
            self._register(seq)
            if seq.finish_reason is not None:
                self.finish(seq, now)
        return got

    def update(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """``advance`` and ``receive`` at once (a step run synchronously); returns the requests that finished."""
        self.advance(out)
        return [s for s in self.receive(out, sampled) if s.is_finished]

    def finish(self, seq: Sequence, now: float | None = None) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # preempted while its last token was in flight
            self.waiting.remove(seq)
        self._release(seq)
        seq.num_inflight = 0
        seq.status = Status.FINISHED
        seq.timing.finished = now or time.perf_counter()
