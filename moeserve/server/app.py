"""The OpenAI-compatible HTTP API: routes, authentication, errors in OpenAI's format.

``build_app(state)`` returns a FastAPI app for a ``ServerState``; the app starts the engine core (a child
process) when it starts, unless it already runs, and stops it on shutdown. Tokenizing, detokenizing, stop
strings and validation happen here, in the front end; the core sees token ids and sampling parameters. Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with a
4xx status; FastAPI's own 422 for malformed JSON or wrong types is answered as a 400 in that format.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.engine.requests import RequestError, RequestLimits, validate_request
from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.tokenizer import (
    TokenTexts, apply_chat_template, generation_defaults, load_chat_template, load_tokenizer,
)
from moeserve.server.outputs import ChoiceOutputs
from moeserve.server.engine_client import EngineClient, RequestStream, SubRequest
from moeserve.server.protocol import (
    APIError, ChatCompletionRequest, ChatFormat, CompletionFormat, CompletionRequest, ModelCard, ModelList,
    PromptTokensDetails, SamplingFields, UsageInfo, new_id, now, validation_error,
)
from moeserve.server.tokenize import add_tokenizer_routes

log = logging.getLogger("moeserve.server")


class ServerState:
    """What the handlers share: the engine client, the tokenizer and the model's limits (from the core),
    the chat template, the request defaults, the served name, the key, the start time."""

    def __init__(self, client: EngineClient, config, served_model_name: str | None = None,
                 api_key: str | None = None):
        self.client = client
        self.config = config
        self.metrics = client.metrics
        self.served_model_name = served_model_name or config.model
        self.api_key = api_key
        self.created = now()
        self.tokenizer = None
        self.token_text = TokenTexts(None)
        self.chat_template = load_chat_template(config.server.chat_template)
        self.defaults: dict = {}
        self.limits: RequestLimits | None = None
        self.info: dict = {}

    @property
    def started(self) -> bool:
        return self.client.started

    def start(self) -> None:
        """Start the engine core and, while it loads the model, the tokenizer (blocking)."""
        from moeserve.config import resolve_model_source
        source = resolve_model_source(self.config.model, self.config.weights_dir)
        defaults = generation_defaults(source.config_dir, self.config.generation_config)
        self.client.spawn()
        try:
            self.tokenizer = load_tokenizer(source.config_dir)
        except BaseException:
            self.client.close(5.0)
            raise
        self.token_text = TokenTexts(self.tokenizer)
        self.defaults = defaults
        ready = self.client.wait_ready()
        self.info = ready.describe
        self.hardware = ready.hardware
        self.max_model_len, self.vocab_size = ready.max_model_len, ready.vocab_size
        self.limits = RequestLimits(ready.vocab_size, ready.max_model_len, self.tokenizer is not None)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.served_model_name}`.", param="model", code="model_not_found")

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("prompt: this model has no tokenizer; send token ids instead of text")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        try:
            return apply_chat_template(self.tokenizer, messages, self.chat_template, add_generation_prompt, **kwargs)
        except ValueError as e:
            if str(e).startswith("messages:"):
                raise APIError.bad_param("messages", str(e)) from None
            raise APIError.bad_param("messages", f"messages: the chat template failed: {type(e).__name__}: {e}") from None
        except Exception as e:
            raise APIError.bad_param("messages", f"messages: the chat template failed: {type(e).__name__}: {e}") from None


def build_app(state: ServerState) -> FastAPI:
    client = state.client

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.started:
            state.start()
        client.attach(asyncio.get_running_loop())
        try:
            yield
        finally:
            await client.aclose()

    app = FastAPI(title="moeserve", description="OpenAI-compatible API of a moeserve engine", lifespan=lifespan)
    app.state.server = state
    _install_error_handlers(app, state)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

    @app.get("/health")
    async def health():
        if not client.is_alive:
            return JSONResponse({"status": "unhealthy", "error": client.error or "the engine is not running"},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(content=state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/version")
    async def version():
        from moeserve import __version__
        return {"version": __version__}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        card = ModelCard(id=state.served_model_name, created=state.created, root=state.config.model,
                         max_model_len=state.max_model_len, vocab_size=state.vocab_size)
        return ModelList(data=[card]).model_dump()

    @app.get("/server_info", dependencies=[Depends(authorize)])
    async def server_info():
        """moeserve's own: the engine's description, configuration, memory and load."""
        memory = await client.call("memory")
        return {"served_model_name": state.served_model_name, "engine": state.info,
                "config": state.config.model_dump(mode="json"), "memory": memory,
                "hardware": state.hardware, "load": client.load(), "front_end_pid": os.getpid()}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request):
        state.check_model(body.model)
        _note_unknown_fields(body)
        job = prepare_completion(state, body)
        return await _respond(request, state, job, CompletionFormat(job.id, state.served_model_name,
                                                                    body.return_token_ids))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state.check_model(body.model)
        _note_unknown_fields(body)
        job = prepare_chat(state, body)
        return await _respond(request, state, job, ChatFormat(job.id, state.served_model_name,
                                                              body.return_token_ids))

    add_tokenizer_routes(app, state, authorize)
    return app


_UNKNOWN_FIELDS_SEEN: set[str] = set()


def _note_unknown_fields(body) -> None:
    """Unknown request fields are ignored (as vLLM does); each name is logged once."""
    new = sorted(set(body.model_extra or ()) - _UNKNOWN_FIELDS_SEEN)
    if new:
        _UNKNOWN_FIELDS_SEEN.update(new)
        log.warning("ignoring request fields this server does not know: %s", ", ".join(new))


async def _respond(request: Request, state: ServerState, job: "Job", fmt):
    stream = state.client.submit(job.subrequests)
    if job.stream:
        return StreamingResponse(_sse_events(state, job, stream, fmt), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    collect = asyncio.ensure_future(_collect(state, job, stream))
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down
        collect.cancel()
        raise
    finally:
        watch.cancel()
    if not collect.done():  # the client went away: stop generating for it and free its pages
        collect.cancel()
        with contextlib.suppress(asyncio.CancelledError, APIError):
            await collect
        return Response(status_code=499)
    items, usage, prompt_logprobs = collect.result()
    return JSONResponse(fmt.response(items, usage, prompt_logprobs))


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    def answer(err: APIError) -> JSONResponse:
        if err.code != "engine_error":  # engine failures are counted as outcome "error" by the engine loop
            state.metrics.request_rejected(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return answer(err)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError):
        return answer(validation_error(list(err.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        message = err.detail if isinstance(err.detail, str) else str(err.detail)
        if err.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return answer(APIError(err.status_code, message, headers=getattr(err, "headers", None)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return answer(APIError(500, f"internal server error: {type(err).__name__}: {err}", code="internal_error"))


# --- from a request to engine sub-requests --------------------------------------------------------

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


# --- from engine tokens to text and events --------------------------------------------------------

def _usage(job: Job, output: ChoiceOutputs) -> UsageInfo:
    prompt = sum(job.prompt_lens)
    completion = sum(len(c.token_ids) for c in output.choices.values())
    # a prompt's n choices share it: count its cached tokens once (its first choice's)
    cached = sum(n for i, n in output.cached_tokens.items() if i % job.n == 0)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse_events(state: ServerState, job: Job, stream: RequestStream, fmt):
    output = ChoiceOutputs(state, job, stream)
    try:
        for chunk in fmt.start(sorted(output.choices)):
            yield _event(chunk)
        while not stream.finished:
            batch = await stream.next_batch()
            try:
                items = output.take(batch)
            except APIError as error:
                yield _event(error.body())
                break
            if items:
                yield _event(fmt.chunk(items, _usage(job, output) if job.continuous_usage else None))
        else:
            if job.include_usage:
                yield _event(fmt.usage_chunk(_usage(job, output)))
        yield "data: [DONE]\n\n"
    finally:
        if not stream.finished:
            state.client.abort(stream.request_ids)


async def _collect(state: ServerState, job: Job, stream: RequestStream):
    output = ChoiceOutputs(state, job, stream)
    try:
        while not stream.finished:
            output.take(await stream.next_batch())
    finally:
        if not stream.finished:
            state.client.abort(stream.request_ids)
    items, prompt_logprobs = output.final()
    return items, _usage(job, output), prompt_logprobs
