"""A request's output on the front end: each choice's tokens, their text (decoded incrementally, as vLLM's
incremental detokenizer), its stop strings and its log-probabilities in the endpoint's shape."""
from __future__ import annotations

from moeserve.server.engine_client import RequestStream
from moeserve.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_json


class ChoiceText:
    """Streaming decodes a small window per step and holds back the tail a stop string could still start
    in. Stop strings are found here (the engine never sees them): once one appears (after ``min_tokens``),
    the choice finishes with ``stop``, its text ends before the stop string, and later tokens are ignored."""

    def __init__(self, tokenizer, skip_special_tokens: bool, stop: list[str], min_tokens: int = 0,
                 incremental: bool = True):
        self.tokenizer, self.skip, self.stop = tokenizer, skip_special_tokens, stop
        self.min_tokens = min_tokens
        self.incremental = incremental or bool(stop)  # non-streaming choices without stop strings decode once
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.stopped = False  # a stop string ended it
        self.text = ""
        self.sent = 0
        self._prefix = self._read = 0
        self._searched = 0
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if self.tokenizer is not None else ""

    def add(self, token_ids: list[int], finish: str | None, logprobs=None) -> str:
        """Take new tokens; return the text to stream now."""
        if self.finish_reason is not None:
            return ""
        self.token_ids.extend(token_ids)
        if logprobs:
            self.logprobs.extend(logprobs)
        if finish is not None:
            self.finish_reason = finish
        if not self.incremental:
            return ""
        if self.tokenizer is not None and token_ids:
            prefix = self._decode(self.token_ids[self._prefix:self._read])
            full = self._decode(self.token_ids[self._prefix:])
            if len(full) > len(prefix) and (finish is not None or not full.endswith("\ufffd")):
                self.text += full[len(prefix):]
                self._prefix, self._read = self._read, len(self.token_ids)
        if self.stop and finish is None and len(self.token_ids) >= self.min_tokens:
            cut = self._cut(self.text, self._searched)
            if cut < len(self.text):
                self.finish_reason, self.stopped = "stop", True
                self.text = self.text[:cut]
            self._searched = max(0, len(self.text) - self._holdback)
        done = self.finish_reason is not None
        end = len(self.text) - (0 if done else self._holdback)
        if done:
            end = max(self.sent, self._cut(self.text))
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    def _cut(self, text: str, start: int = 0) -> int:
        cuts = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(cuts) if cuts else len(text)

    def final_text(self) -> str:
        """The whole text decoded at once, cut at the first stop string (as ``LLM.generate`` returns it)."""
        text = self._decode(self.token_ids)
        return text[:self._cut(text)]


class ChoiceOutputs:
    """Folds a stream's deltas into its choices: text, stop strings (a choice a stop string ends is aborted
    in the engine at once), and log-probabilities in the endpoint's shape."""

    def __init__(self, state, job, stream: RequestStream):
        """``state``: the app's ``ServerState``; ``job``: the request's ``Job``."""
        self.state, self.job, self.stream = state, job, stream
        self.choices = {s.index: ChoiceText(state.tokenizer, job.skip_special_tokens, job.stop, job.min_tokens,
                                            job.stream) for s in job.subrequests}
        self.echoed: set[int] = set()
        self.prompt_logprobs: dict[int, list] = {}
        self.cached_tokens: dict[int, int] = {}  # prompt tokens each choice found in the prefix cache
        self.offsets = dict.fromkeys(self.choices, 0)  # text sent so far per choice (completions' text_offset)

    def take(self, batch) -> list[tuple]:
        """Fold a batch of deltas; return the stream items ``(index, text, token_ids, finish, logprobs)``.
        Raises the first error among them."""
        job = self.job
        merged: dict[int, list] = {}
        for d in batch:
            if d.error is not None:
                raise d.error
            entry = merged.setdefault(d.index, [[], None, []])
            entry[0].extend(d.token_ids)
            entry[1] = d.finish_reason or entry[1]
            entry[2].extend(d.logprobs or [])
            if d.prompt_logprobs is not None:
                self.prompt_logprobs[d.index] = d.prompt_logprobs
            if d.num_cached_tokens is not None:
                self.cached_tokens[d.index] = d.num_cached_tokens
        items = []
        for i, (toks, finish, lps) in merged.items():
            c = self.choices[i]
            if c.finish_reason is not None:
                continue
            if job.echo_only:
                toks, lps = [], []
            before = len(c.token_ids)
            text = c.add(toks, finish, lps)
            if c.stopped:  # a stop string: the engine need not go on
                self.state.client.abort([self.stream.request_id(i)], outcome="stop")
                self.stream.unfinished.discard(i)
            new_ids = c.token_ids[before:]
            if job.stream:
                items.append(self._stream_item(i, c, text, new_ids, c.logprobs[before:]))
        return items

    def _stream_item(self, i: int, c: ChoiceText, text: str, ids: list[int], lps: list) -> tuple:
        job = self.job
        prompt_ids, prompt_lps = [], []
        if job.echo and i not in self.echoed:
            self.echoed.add(i)
            text = job.prompt_texts[job.prompt_of(i)] + text
            prompt_ids = job.prompts[job.prompt_of(i)]
            prompt_lps = self.prompt_logprobs.get(i) or [None] * len(prompt_ids)
        logprobs = self._logprobs(prompt_ids + ids, prompt_lps + lps, self.offsets[i])
        self.offsets[i] += len(text)
        return (i, text, ids, c.finish_reason, logprobs)

    def _logprobs(self, ids: list[int], lps: list, offset: int = 0):
        job = self.job
        if job.logprobs is None:
            return None
        if job.chat:
            return chat_logprobs(ids, lps, job.logprobs, self.state.token_text)
        return completion_logprobs(ids, lps, job.logprobs, self.state.token_text, offset)

    def final(self) -> tuple[list[tuple], dict]:
        """The whole response's items and (completions) each choice's prompt_logprobs."""
        job = self.job
        items = []
        for i, c in sorted(self.choices.items()):
            text, ids, lps = c.final_text(), list(c.token_ids), list(c.logprobs)
            if job.echo:
                p = job.prompt_of(i)
                text = job.prompt_texts[p] + text
                logprobs = self._logprobs(job.prompts[p] + ids, (self.prompt_logprobs.get(i) or
                                                                 [None] * job.prompt_lens[p]) + lps)
            else:
                logprobs = self._logprobs(ids, lps)
            items.append((i, text, ids, c.finish_reason, logprobs))
        prompt_logprobs = {}
        if job.prompt_logprobs is not None:
            prompt_logprobs = {i: prompt_logprobs_json(v, job.prompt_logprobs, self.state.token_text)
                               for i, v in self.prompt_logprobs.items()}
        return items, prompt_logprobs
