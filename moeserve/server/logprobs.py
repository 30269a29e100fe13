"""Log-probabilities in OpenAI's response shapes (as vLLM returns them).

- completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; ``top_logprobs[i]`` maps the
  text of the sampled token and of the top-N tokens to their log-probabilities (up to N + 1 entries, as
  OpenAI documents); with ``echo`` the prompt's tokens come first, the first with ``null``s.
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.
- vLLM's ``prompt_logprobs``: per prompt token ``null`` (the first) or ``{token_id: {"logprob", "rank",
  "decoded_token"}}``.
"""
from __future__ import annotations

from moeserve.engine.step import TokenLogprobs

FLOOR = -9999.0  # -inf is not JSON; OpenAI and vLLM send this instead


def _lp(value: float) -> float:
    return max(value, FLOOR)


def completion_logprobs(token_ids: list[int], items: list[TokenLogprobs | None], num_top: int, token_text,
                        initial_offset: int = 0) -> dict:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = initial_offset
    for tid, lp in zip(token_ids, items):
        text = token_text(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_lp(lp.logprob))
        top = {text: _lp(lp.logprob)}
        for alt, value in lp.top[:num_top]:
            top.setdefault(token_text(alt), _lp(value))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _entry(text: str, value: float) -> dict:
    return {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(token_ids: list[int], items: list[TokenLogprobs], num_top: int, token_text) -> dict:
    content = []
    for tid, lp in zip(token_ids, items):
        entry = _entry(token_text(tid), lp.logprob)
        entry["top_logprobs"] = [_entry(token_text(alt), value) for alt, value in lp.top[:num_top]]
        content.append(entry)
    return {"content": content}


def prompt_logprobs_json(items: list[TokenLogprobs | None], num_top: int, token_text) -> list[dict | None]:
    out = []
    for lp in items:
        if lp is None:
            out.append(None)
            continue
        d = {lp.token_id: {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": token_text(lp.token_id)}}
        for rank, (alt, value) in enumerate(lp.top[:num_top], start=1):
            d.setdefault(alt, {"logprob": _lp(value), "rank": rank, "decoded_token": token_text(alt)})
        out.append(d)
    return out
