"""The step contract between the scheduler and the model runner: plain data only.

A ``StepInput`` says everything a runner needs to run one step: for each scheduled request the tokens it
feeds, where they go in the KV cache and how to sample. A ``StepOutput`` gives back one sampled token per
request (``None`` where a request only fed a prompt chunk). Both are dataclasses of ints, floats, strings
and lists, so they pickle and cross a process boundary as they are (to an engine-core process, to the
workers of other GPUs); no live ``Sequence`` crosses it.

Random state stays on the side that samples: a request's ``seed`` crosses, and the runner's sampler keeps
each seeded request's random stream (dropped when the request shows up in ``finished_request_ids``), so a
seeded request gets the same tokens whatever else shares its batches.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def is_decode(start: int, num_tokens: int) -> bool:
    """A request's part of a step is a decode when it feeds one token after tokens already in the cache."""
    return num_tokens == 1 and start > 0


@dataclass(slots=True)
class SamplingRow:
    """How to pick a request's next token (``SamplingParams`` reduced to what the sampler reads)."""

    temperature: float = 1.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    num_generated: int = 0  # tokens the request has generated so far: the offset of its seeded stream
    logprobs: int | None = None  # top-N log-probabilities of each sampled token (None: none)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def filters(self) -> tuple[bool, bool, bool]:
        """Which of top-k, top-p and min-p this row uses."""
        return self.top_k > 0, self.top_p < 1, self.min_p > 0


@dataclass(slots=True)
class ScheduledRequest:
    """One request's part of a step."""

    request_id: str
    start: int  # tokens already in the KV cache
    token_ids: list[int]  # the tokens fed this step (an in-flight last token is a 0 placeholder)
    pages: list[int]  # the KV pages holding positions [0, start + len(token_ids))
    samples: bool  # the step feeds the request's last pending token, so it samples a new one
    inflight_row: int = -1  # >= 0: the last fed token is still on the device, row of the previous step's tokens
    sampling: SamplingRow | None = None  # set when ``samples``
    prompt_logprobs: int | None = None  # top-N log-probabilities of the fed prompt tokens (None: none)
    # with ``prompt_logprobs``: the prompt token after this chunk (None when the chunk ends the prompt), the
    # target of the chunk's last position
    next_prompt_token: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return is_decode(self.start, len(self.token_ids))


@dataclass
class StepInput:
    step_id: int
    requests: list[ScheduledRequest]
    finished_request_ids: list[str] = field(default_factory=list)  # gone since the last step

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def is_decode(self) -> bool:
        return bool(self.requests) and all(r.is_decode for r in self.requests)

    @property
    def sampling_requests(self) -> list[ScheduledRequest]:
        """The requests that sample, in the order of the step's sampled tokens."""
        return [r for r in self.requests if r.samples]


@dataclass
class TokenLogprobs:
    """The log-probability of one token and the top-N alternatives at its position (float32 log-softmax of
    the unmodified logits)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass
class StepOutput:
    step_id: int
    sampled: list[int | None]  # per request of the step: its new token, None where it did not sample
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # request id -> its sampled token's
    # request id -> the log-probabilities of the prompt tokens at positions start + 1 ... of its chunk (each
    # position's logits scored against the prompt token after it)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
