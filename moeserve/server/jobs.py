"""From an OpenAI request to engine sub-requests: sampling parameters (request fields over the model's
generation_config defaults), validation against the model's limits in OpenAI's error format, one sub-request
per prompt and choice."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moeserve.engine.requests import RequestError, validate_request
from moeserve.engine.sampling_params import SamplingParams
from moeserve.server.engine_client import SubRequest
from moeserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields, new_id
from moeserve.server.state import ServerState


@dataclass
class Job:
    """One HTTP request as engine sub-requests: choice ``index = prompt * n + j``."""

    id: str
    subrequests: list[SubRequest]
    prompt_lens: list[int]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    stop: list[str]
    skip_special_tokens: bool
    min_tokens: int = 0
    n: int = 1
    prompts: list[list[int]] | None = None
    logprobs: int | None = None  # top-N alternatives of each output token (None: no logprobs)
    chat: bool = False  # logprobs in the chat shape
    echo: bool = False  # completions: the prompt comes first in text (and logprobs)
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, no output tokens
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs extension (completions)
    prompt_texts: list[str] | None = None

    def prompt_of(self, index: int) -> int:
        return index // self.n


def _sampling_params(body: SamplingFields, max_tokens: int | None, defaults: dict | None = None,
                     **extra) -> SamplingParams:
    for param, message in body.unsupported():
        raise APIError.bad_param(param, message)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    fallback = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    fallback |= {k: v for k, v in (defaults or {}).items() if k in fallback}
    given = {name: getattr(body, name) for name in fallback}
    try:
        return SamplingParams(
            n=body.n, **{k: fallback[k] if v is None else v for k, v in given.items()}, seed=body.seed,
            max_tokens=max_tokens, min_tokens=body.min_tokens, stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos, stop=stop, **extra)
    except ValueError as e:
        raise APIError.from_message(str(e)) from None


def _make_job(state: ServerState, body: SamplingFields, prompts: list[list[int]], limit: int | None,
              limit_name: str, prompt_param: str, prefix: str, **logprob_fields) -> Job:
    if limit is not None and limit < 1:
        raise APIError.bad_param(limit_name, f"{limit_name}: must be a positive integer, got {limit}")
    max_queue_len = state.client.max_queue_len
    if body.n * len(prompts) > max_queue_len:
        raise APIError.bad_param("n", f"n: {body.n} choices x {len(prompts)} prompt(s) = {body.n * len(prompts)} "
                                      "sequences, more than the server queues at once "
                                      f"(server.max_queue_len {max_queue_len})")
    per_prompt = []
    for k, ids in enumerate(prompts):
        where = prompt_param if len(prompts) == 1 else f"{prompt_param}[{k}]"
        room = max(state.max_model_len - len(ids), 1)  # the default output limit: what is left of the context
        cap = state.defaults.get("max_tokens")  # generation_config's max_new_tokens bounds every request, as in vLLM
        wanted = room if limit is None else limit
        params = _sampling_params(body, wanted if cap is None else min(wanted, cap), state.defaults,
                                  **logprob_fields)
        try:
            validate_request(ids, params, state.limits, strict_max_tokens=True, where=where)
        except RequestError as e:
            msg = str(e)
            if msg.startswith("max_tokens:"):
                msg = limit_name + msg[len("max_tokens"):]
            raise APIError.from_message(msg, prompt_param) from None
        per_prompt.append(params)
    job_id = new_id(prefix)
    subs = []
    for k, (ids, params) in enumerate(zip(prompts, per_prompt)):
        for j in range(body.n):
            try:  # stop strings are found here, in the front end: the engine does not see them
                sub = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + j, stop=[])
            except ValueError as e:
                raise APIError.from_message(str(e)) from None
            subs.append(SubRequest(f"{job_id}-{k * body.n + j}", ids, sub, index=k * body.n + j))
    stream_options = body.stream_options
    include_usage = bool(stream_options and stream_options.include_usage)
    return Job(job_id, subs, [len(p) for p in prompts], body.stream, include_usage,
               include_usage and stream_options.continuous_usage_stats, per_prompt[0].stop, body.skip_special_tokens,
               min_tokens=body.min_tokens, n=body.n, prompts=prompts)


def prepare_completion(state: ServerState, body: CompletionRequest) -> Job:
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError.bad_param("prompt", "prompt: must not be empty")
    texts = None
    if isinstance(prompt[0], int):
        prompts = [list(prompt)]
    elif isinstance(prompt[0], str):
        try:
            prompts = [state.tokenize(p) for p in prompt]
        except RequestError as e:
            raise APIError.from_message(str(e), "prompt") from None
        texts = list(prompt)
    else:
        prompts = [list(p) for p in prompt]
    limit = body.max_tokens
    echo_only = body.echo and limit == 0
    if echo_only:
        limit = 1  # the engine computes the prompt (and samples one token, dropped here)
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    job = _make_job(state, body, prompts, limit, "max_tokens", "prompt", "cmpl", logprobs=body.logprobs,
                    prompt_logprobs=prompt_logprobs)
    job.logprobs, job.echo, job.echo_only, job.prompt_logprobs = body.logprobs, body.echo, echo_only, body.prompt_logprobs
    if body.echo:
        job.prompt_texts = texts or [_decode(state, ids) for ids in prompts]
    return job


def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> Job:
    messages = body.template_messages()
    ids = state.chat_prompt(messages, body.add_generation_prompt, **(body.chat_template_kwargs or {}))
    top = body.top_logprobs or 0 if body.logprobs else None
    job = _make_job(state, body, [ids], body.output_limit(), body.output_limit_name(), "messages", "chatcmpl",
                    logprobs=top)
    job.logprobs, job.chat = top, True
    return job


def _decode(state: ServerState, ids: list[int]) -> str:
    return state.tokenizer.decode(ids) if state.tokenizer is not None else ""
