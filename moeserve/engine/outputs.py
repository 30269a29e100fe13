"""What a request gives back, in vLLM's shape: ``RequestOutput.outputs[0].token_ids``, ``.logprobs`` (one
``{token_id: Logprob}`` per output token) and ``RequestOutput.prompt_logprobs`` (``None`` for the first
prompt token)."""
from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.engine.step import TokenLogprobs


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprobs_dict(lp: TokenLogprobs, token_text) -> dict[int, Logprob]:
    """vLLM's per-position dict: the scored token first, then the top-N (most likely first)."""
    out = {lp.token_id: Logprob(lp.logprob, lp.rank, token_text(lp.token_id))}
    for rank, (tid, value) in enumerate(lp.top, start=1):
        if tid not in out:
            out[tid] = Logprob(value, rank, token_text(tid))
    return out


def logprobs_dicts(items: list[TokenLogprobs | None] | None, tokenizer) -> list[dict[int, Logprob] | None] | None:
    if items is None:
        return None
    from moeserve.engine.tokenizer import TokenTexts
    texts = TokenTexts(tokenizer)
    return [None if lp is None else logprobs_dict(lp, texts) for lp in items]


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first scheduled
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
