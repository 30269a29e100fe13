"""The OpenAI-compatible HTTP API: routes, authentication, errors in OpenAI's format.

``build_app(state)`` returns a FastAPI app for a ``ServerState``; the app starts the engine core (a child
process) when it starts, unless it already runs, and stops it on shutdown. Tokenizing, detokenizing, stop
strings and validation happen here, in the front end (``server.jobs``, ``server.state``); the core sees token
ids and sampling parameters. Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status; FastAPI's own 422 for malformed JSON or wrong types is answered as a 400 in that format.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.server.engine_client import RequestStream
from moeserve.server.jobs import Job, prepare_chat, prepare_completion
from moeserve.server.outputs import ChoiceOutputs
from moeserve.server.protocol import (
    APIError, ChatCompletionRequest, ChatFormat, CompletionFormat, CompletionRequest, ModelCard, ModelList,
    PromptTokensDetails, UsageInfo, validation_error,
)
from moeserve.server.state import ServerState
from moeserve.server.tokenize import add_tokenizer_routes

__all__ = ["ServerState", "build_app"]

log = logging.getLogger("moeserve.server")


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


async def _respond(request: Request, state: ServerState, job: Job, fmt):
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
