"""Request validation: the one check every entry point runs (``LLM.generate``, ``LLMEngine.add_request``, the
HTTP server) before a request touches any state, so a bad request is refused with a message naming the
parameter and nothing else is affected."""
from __future__ import annotations

from dataclasses import dataclass

from moeserve.engine.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses; the message names the parameter and the problem."""


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the model's vocabulary and context, and whether text is available."""

    vocab_size: int
    max_model_len: int
    has_tokenizer: bool = False


def validate_request(prompt_token_ids, params: SamplingParams, limits: RequestLimits,
                     strict_max_tokens: bool = False, where: str = "prompt") -> None:
    """Raise ``RequestError`` when the request cannot run. ``strict_max_tokens`` also refuses a ``max_tokens``
    that does not fit in the context after the prompt (the OpenAI server does, as vLLM's); otherwise
    generation just stops at ``max_model_len``. ``where`` names the prompt in messages (``prompt[2]``)."""
    if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
        raise RequestError(f"{where}: must hold at least one token")
    vocab, L = limits.vocab_size, limits.max_model_len
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt_token_ids):
        raise RequestError(f"{where}: every token id must be an integer in [0, {vocab})")
    n = len(prompt_token_ids)
    if n >= L:
        raise RequestError(f"{where}: the prompt has {n} tokens but this model's maximum context length "
                           f"(max_model_len) is {L} tokens; at least one token must be left for the output")
    try:
        params.validate()
    except ValueError as e:
        raise RequestError(str(e)) from None
    if strict_max_tokens and params.max_tokens is not None and n + params.max_tokens > L:
        raise RequestError(f"max_tokens: {params.max_tokens} is too large: this model's maximum context length "
                           f"(max_model_len) is {L} tokens and the prompt has {n} tokens "
                           f"({n} + {params.max_tokens} > {L})")
    if params.stop and not limits.has_tokenizer:
        raise RequestError("stop: stop strings need a tokenizer; use stop_token_ids with this model")
