"""The OpenAI-compatible HTTP API: routes, authentication, errors in OpenAI's format.

``build_app(async_engine, ...)`` returns a FastAPI app; the app starts the engine loop when it starts
and stops it on shutdown. Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with a
4xx status; FastAPI's own 422 for malformed JSON or wrong types is answered as a 400 in that format.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.engine.requests import RequestError, validate_request
from moeserve.engine.sampling_params import SamplingParams
from moeserve.server.async_engine import AsyncEngine, RequestStream, SubRequest
from moeserve.server.protocol import (
    APIError, ChatCompletionRequest, ChatFormat, CompletionFormat, CompletionRequest, ModelCard, ModelList,
    SamplingFields, UsageInfo, new_id, now, validation_error,
)

log = logging.getLogger("moeserve.server")


class ServerState:
    """What the handlers share: the engine loop, the served name, the key, the start time."""

    def __init__(self, async_engine: AsyncEngine, served_model_name: str, api_key: str | None):
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.metrics = async_engine.metrics
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.created = now()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.served_model_name}`.", param="model", code="model_not_found")


def build_app(async_engine: AsyncEngine, served_model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    state = ServerState(async_engine, served_model_name or async_engine.engine.config.model, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)

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
        if not async_engine.is_alive:
            return JSONResponse({"status": "unhealthy", "error": repr(async_engine.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(content=state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        engine = state.engine
        card = ModelCard(id=state.served_model_name, created=state.created, root=engine.config.model,
                         max_model_len=engine.max_model_len, vocab_size=engine.arch.vocab_size)
        return ModelList(data=[card]).model_dump()

    @app.get("/server_info", dependencies=[Depends(authorize)])
    async def server_info():
        """moeserve's own: the engine's description, configuration, memory and load."""
        engine = state.engine
        return {"served_model_name": state.served_model_name, "engine": engine.describe(),
                "config": engine.config.model_dump(mode="json"), "memory": engine.memory_report(),
                "hardware": engine.hardware.to_dict(), "load": async_engine.load()}

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

    return app


_UNKNOWN_FIELDS_SEEN: set[str] = set()


def _note_unknown_fields(body) -> None:
    """Unknown request fields are ignored (as vLLM does); each name is logged once."""
    new = sorted(set(body.model_extra or ()) - _UNKNOWN_FIELDS_SEEN)
    if new:
        _UNKNOWN_FIELDS_SEEN.update(new)
        log.warning("ignoring request fields this server does not know: %s", ", ".join(new))


async def _respond(request: Request, state: ServerState, job: "Job", fmt):
    stream = state.async_engine.submit(job.subrequests)
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
    items, usage = collect.result()
    return JSONResponse(fmt.response(items, usage))


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


def _sampling_params(body: SamplingFields, max_tokens: int | None) -> SamplingParams:
    for param, message in body.unsupported():
        raise APIError.bad_param(param, message)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        return SamplingParams(
            n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=0 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p, seed=body.seed, max_tokens=max_tokens,
            min_tokens=body.min_tokens, stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos, stop=stop)
    except ValueError as e:
        raise APIError.from_message(str(e)) from None


def _make_job(state: ServerState, body: SamplingFields, prompts: list[list[int]], limit: int | None,
              limit_name: str, prompt_param: str, prefix: str) -> Job:
    engine = state.engine
    if limit is not None and limit < 1:
        raise APIError.bad_param(limit_name, f"{limit_name}: must be a positive integer, got {limit}")
    if body.n * len(prompts) > state.async_engine.max_queue_len:
        raise APIError.bad_param("n", f"n: {body.n} choices x {len(prompts)} prompt(s) = {body.n * len(prompts)} "
                                      "sequences, more than the server queues at once "
                                      f"(server.max_queue_len {state.async_engine.max_queue_len})")
    per_prompt = []
    for k, ids in enumerate(prompts):
        where = prompt_param if len(prompts) == 1 else f"{prompt_param}[{k}]"
        room = max(engine.max_model_len - len(ids), 1)  # the default output limit: what is left of the context
        params = _sampling_params(body, limit if limit is not None else room)
        try:
            validate_request(ids, params, engine.limits, strict_max_tokens=True, where=where)
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
            try:
                sub = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + j)
            except ValueError as e:
                raise APIError.from_message(str(e)) from None
            subs.append(SubRequest(f"{job_id}-{k * body.n + j}", ids, sub, index=k * body.n + j))
    stream_options = body.stream_options
    include_usage = bool(stream_options and stream_options.include_usage)
    return Job(job_id, subs, [len(p) for p in prompts], body.stream, include_usage,
               include_usage and stream_options.continuous_usage_stats, per_prompt[0].stop, body.skip_special_tokens)


def prepare_completion(state: ServerState, body: CompletionRequest) -> Job:
    engine = state.engine
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError.bad_param("prompt", "prompt: must not be empty")
    if isinstance(prompt[0], int):
        prompts = [list(prompt)]
    elif isinstance(prompt[0], str):
        try:
            prompts = [engine.tokenize(p) for p in prompt]
        except RequestError as e:
            raise APIError.from_message(str(e), "prompt") from None
    else:
        prompts = [list(p) for p in prompt]
    return _make_job(state, body, prompts, body.max_tokens, "max_tokens", "prompt", "cmpl")


def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> Job:
    tok = state.engine.tokenizer
    if tok is None:
        raise APIError.bad_param("messages", "messages: this model has no tokenizer, so chat is not available; "
                                 "use /v1/completions with token-id prompts")
    if not getattr(tok, "chat_template", None):
        raise APIError.bad_param("messages", "messages: this model's tokenizer has no chat template; "
                                 "use /v1/completions")
    messages = body.template_messages()
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                                       **(body.chat_template_kwargs or {}))
        ids = tok.encode(text, add_special_tokens=False)
    except Exception as e:
        raise APIError.bad_param("messages", f"messages: the chat template failed: {type(e).__name__}: {e}") from None
    return _make_job(state, body, [ids], body.output_limit(), body.output_limit_name(), "messages", "chatcmpl")


# --- from engine tokens to text and events --------------------------------------------------------

class ChoiceText:
    """One choice's tokens and text. Streaming decodes a small window per step (vLLM's incremental
    detokenizer) and holds back the tail a stop string could still start in."""

    def __init__(self, tokenizer, skip_special_tokens: bool, stop: list[str]):
        self.tokenizer, self.skip, self.stop = tokenizer, skip_special_tokens, stop
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.text = ""
        self.sent = 0
        self._prefix = self._read = 0
        self._holdback = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if self.tokenizer is not None else ""

    def add(self, token_ids: list[int], finish: str | None) -> str:
        """Take new tokens; return the text to stream now."""
        self.token_ids.extend(token_ids)
        if finish is not None:
            self.finish_reason = finish
        if self.tokenizer is not None and token_ids:
            prefix = self._decode(self.token_ids[self._prefix:self._read])
            full = self._decode(self.token_ids[self._prefix:])
            if len(full) > len(prefix) and (finish is not None or not full.endswith("\ufffd")):
                self.text += full[len(prefix):]
                self._prefix, self._read = self._read, len(self.token_ids)
        end = len(self.text) - (0 if finish is not None else self._holdback)
        if finish is not None:
            end = max(self.sent, self._cut(self.text))
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    def _cut(self, text: str) -> int:
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(cuts) if cuts else len(text)

    def final_text(self) -> str:
        """The whole text decoded at once, cut at the first stop string (as ``LLM.generate`` returns it)."""
        text = self._decode(self.token_ids)
        return text[:self._cut(text)]


def _usage(job: Job, choices: dict[int, ChoiceText]) -> UsageInfo:
    prompt = sum(job.prompt_lens)
    completion = sum(len(c.token_ids) for c in choices.values())
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _choices(state: ServerState, job: Job) -> dict[int, ChoiceText]:
    return {s.index: ChoiceText(state.engine.tokenizer, job.skip_special_tokens, job.stop) for s in job.subrequests}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse_events(state: ServerState, job: Job, stream: RequestStream, fmt):
    choices = _choices(state, job)
    try:
        for chunk in fmt.start(sorted(choices)):
            yield _event(chunk)
        while not stream.finished:
            batch = await stream.next_batch()
            error = next((d.error for d in batch if d.error is not None), None)
            if error is not None:
                yield _event(error.body())
                break
            merged: dict[int, list] = {}
            for d in batch:
                entry = merged.setdefault(d.index, [[], None])
                entry[0].extend(d.token_ids)
                entry[1] = d.finish_reason or entry[1]
            items = [(i, choices[i].add(toks, finish), toks, finish) for i, (toks, finish) in merged.items()]
            yield _event(fmt.chunk(items, _usage(job, choices) if job.continuous_usage else None))
        else:
            if job.include_usage:
                yield _event(fmt.usage_chunk(_usage(job, choices)))
        yield "data: [DONE]\n\n"
    finally:
        if not stream.finished:
            state.async_engine.abort(stream.request_ids)


async def _collect(state: ServerState, job: Job, stream: RequestStream):
    choices = _choices(state, job)
    try:
        while not stream.finished:
            for d in await stream.next_batch():
                if d.error is not None:
                    raise d.error
                c = choices[d.index]
                c.token_ids.extend(d.token_ids)
                c.finish_reason = d.finish_reason or c.finish_reason
    finally:
        if not stream.finished:
            state.async_engine.abort(stream.request_ids)
    items = [(i, c.final_text(), c.token_ids, c.finish_reason) for i, c in sorted(choices.items())]
    return items, _usage(job, choices)
