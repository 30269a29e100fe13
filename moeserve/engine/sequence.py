"""One request's state as it moves through the engine: tokens, pages, progress, timing."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from moeserve.engine.kv_cache import page_hash
from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.step import SamplingRow, TokenLogprobs


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Timing:
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


class Sequence:
    """A request's tokens and cache pages.

    ``num_computed`` counts the leading tokens whose keys and values are in the cache; the tokens after
    it are what the next steps must feed through the model (a prompt, a prompt's remaining chunk, or the
    one token sampled last step). Preemption frees the pages and sets ``num_computed`` back to 0, so the
    whole sequence is recomputed as if it were a prompt.

    With asynchronous scheduling the engine launches the next step before the tokens of the last one reach
    the host: ``num_inflight`` counts the sampled tokens still on the device. They count in ``num_tokens``
    (the scheduler plans around them, and the step that feeds one reads it from the device at ``last_row``
    of the previous step's tokens), but not in ``output_token_ids``, which holds only tokens the host has.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), max_model_len: int = 1 << 30, cache_salt: str | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.status = Status.WAITING
        self.num_computed = 0
        self.pages: list[int] = []
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.timing = Timing()
        self.num_inflight = 0  # sampled tokens not yet on the host
        self.last_row = -1  # row of the newest in-flight token in its step's sampled tokens
        # prefix caching: the chained hashes of its full pages of known tokens, how many of its pages are
        # registered in the cache, the salt that keeps its cache entries apart, and the prompt tokens it found
        # cached when first scheduled
        self.cache_salt = cache_salt
        self.page_hashes: list[bytes] = []
        self.num_registered = 0
        self.num_cached_tokens = 0
        # log-probabilities asked for: one entry per output token, and per prompt token (None for the first)
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)

    # --- sizes ---------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens so far, the in-flight ones included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def num_resolved(self) -> int:
        """Tokens whose ids the host has (prompt and received outputs)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_generated(self) -> int:
        """Sampled tokens so far, the in-flight ones included."""
        return len(self.output_token_ids) + self.num_inflight

    @property
    def done_by_length(self) -> bool:
        """Its sampled tokens (some maybe in flight) already reach ``max_tokens`` or ``max_model_len``, so no
        further step has anything to compute for it."""
        return self._reaches_length(self.num_generated, self.num_tokens)

    def _reaches_length(self, num_generated: int, num_tokens: int) -> bool:
        max_tokens = self.params.max_tokens
        return (max_tokens is not None and num_generated >= max_tokens) or num_tokens >= self.max_model_len

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    def full_page_hashes(self, page_size: int) -> list[bytes]:
        """The chained hashes of its full pages whose tokens are all on the host (extended as tokens arrive)."""
        hashes = self.page_hashes
        for i in range(len(hashes), self.num_resolved // page_size):
            tokens = self.token_slice(i * page_size, (i + 1) * page_size)
            hashes.append(page_hash(hashes[-1] if hashes else None, tokens, self.cache_salt if i == 0 else None))
        return hashes

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)``; only resolved tokens have ids on the host."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def sampling_row(self) -> SamplingRow:
        """What the sampler needs for this request's next token."""
        p = self.params
        return SamplingRow(p.temperature, p.effective_top_k, p.top_p, p.min_p, p.seed, self.num_generated,
                           p.logprobs)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def prompt_logprobs_wanted(self, start: int, end: int) -> bool:
        """Whether a chunk feeding ``[start, end)`` scores prompt tokens not scored yet (a recomputation after
        preemption does not score them again)."""
        pl = self.prompt_logprobs
        # the chunk scores the prompt tokens at start + 1 ... min(end, P - 1)
        return pl is not None and min(end, self.num_prompt_tokens - 1) >= max(len(pl), start + 1)

    def add_prompt_logprobs(self, start: int, items: list[TokenLogprobs]) -> None:
        """Scores of the prompt tokens at ``start + 1, start + 2, ...`` (from a chunk starting at ``start``)."""
        pl = self.prompt_logprobs
        if pl is None:
            return
        skip = len(pl) - (start + 1)  # already scored before a preemption
        if skip >= 0:
            pl.extend(items[skip:])

    # --- progress ------------------------------------------------------------------------------
    def receive_token(self, token: int, now: float) -> None:
        """The oldest in-flight token reaches the host."""
        self.num_inflight -= 1
        self.append_token(token, now)

    def append_token(self, token: int, now: float) -> None:
        self.output_token_ids.append(token)
        if self.timing.first_token is None:
            self.timing.first_token = now
        self.timing.token_times.append(now)
        self._check_stop(token)

    def _check_stop(self, token: int) -> None:
        p = self.params
        n_out = len(self.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                self.finish_reason = "stop"
            elif token in p.stop_token_ids:
                self.finish_reason = "stop"
        if self.finish_reason is None and self._reaches_length(n_out, self.num_resolved):
            self.finish_reason = "length"

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed}, pages={len(self.pages)})")
