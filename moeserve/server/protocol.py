"""The OpenAI API's request and response shapes, as pydantic models, and its error format.

Requests are validated strictly (``"5"`` is not an integer, ``1`` is not a boolean); fields the API does
not know are ignored, as vLLM does, and logged. Parameters moeserve cannot honour (penalties, tools,
suffix, ...) are refused with a 400 naming them rather than silently dropped.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error answered in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def bad_param(cls, param: str | None, message: str) -> "APIError":
        return cls(400, message, param=param, code="invalid_value" if param else "invalid_request")

    @classmethod
    def from_message(cls, message: str, default_param: str | None = None) -> "APIError":
        """A 400 for an engine message of the form ``"param: why"``."""
        head, sep, _ = message.partition(":")
        param = head.strip() if sep and head.strip().isidentifier() else default_param
        return cls.bad_param(param, message)


def _looks_like_type_name(part) -> bool:
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "list", "dict", "none"} or "[" in part)


def _param_path(loc) -> str | None:
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if _looks_like_type_name(part):
            break
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def validation_error(errors: list[dict]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one 400 that names the first bad parameter."""
    if not errors:
        return APIError.bad_param(None, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError.bad_param(None, f"the request body is not valid JSON: {detail}".rstrip(": "))
    param = _param_path(first.get("loc", ()))
    if param is None:
        if first.get("type") == "missing":
            return APIError.bad_param(None, "the request needs a JSON body")
        return APIError.bad_param(None, f"the request body must be a JSON object, got {first.get('input')!r}"[:300])
    same = [e for e in errors if _param_path(e.get("loc", ())) == param]
    got = repr(first.get("input"))[:200]
    if first.get("type") == "missing":
        return APIError.bad_param(param, f"{param}: this field is required")
    if len(same) > 1:
        kinds = [str(p) for e in same for p in e.get("loc", ()) if _looks_like_type_name(p)]
        expected = ", ".join(dict.fromkeys(kinds)) or "another type"
        return APIError.bad_param(param, f"{param}: invalid value {got}; expected one of {expected}")
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    return APIError.bad_param(param, f"{param}: {msg} (got {got})")


def parse_request(model: type[BaseModel], data: Any) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# --- requests ------------------------------------------------------------------------------------

class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Request):
    """The sampling and control parameters completions and chat share (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    return_token_ids: bool = False

    def unsupported(self) -> list[tuple[str, str]]:
        """(parameter, why) for every parameter set to a value moeserve does not implement."""
        out = []
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                out.append((name, f"{name}: penalties are not supported; send 0 or leave it out"))
        if self.repetition_penalty not in (None, 1, 1.0):
            out.append(("repetition_penalty", "repetition_penalty: not supported; send 1.0 or leave it out"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias: not supported"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options: only allowed when stream is true"))
        return out


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.suffix is not None:
            out.append(("suffix", "suffix: not supported"))
        if self.best_of is not None and self.best_of != self.n:
            out.append(("best_of", "best_of: not supported; leave it out or set it equal to n"))
        return out


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs: needs logprobs set to true"))
        elif self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            out.append(("top_logprobs", f"top_logprobs: must be an integer in [0, 20], got {self.top_logprobs}"))
        if self.tools:
            out.append(("tools", "tools: tool calling is not supported"))
        if self.tool_choice not in (None, "none", "auto"):
            out.append(("tool_choice", "tool_choice: tool calling is not supported"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "response_format: only {'type': 'text'} is supported"))
        return out

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def output_limit_name(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def template_messages(self) -> list[dict]:
        return template_messages(self.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as plain dicts for ``apply_chat_template``; content parts must be text."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError.bad_param(f"messages[{i}].content[{j}]",
                                             f"messages[{i}].content[{j}]: only text parts are supported, "
                                             f"got type {part.type!r}")
                texts.append(part.text)
            content = "\n".join(texts)
        msg = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a ``prompt`` or chat ``messages`` (through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# --- responses -----------------------------------------------------------------------------------

class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, dict] | None] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobsContent(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(_Response):
    content: list[ChatLogprobsContent] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moeserve"
    root: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- response shaping ----------------------------------------------------------------------------
# A choice's output as the handlers hand it over: (index, text, token_ids, finish_reason, logprobs), the
# logprobs already in the endpoint's shape (or None); completions may add each choice's
# ``prompt_logprobs`` (vLLM's extension) to the full response. Stream chunks
# are built as plain dicts (one per step per request, so they stay cheap); they have the shapes of
# ``CompletionChunk`` and ``ChatCompletionChunk`` above.

class CompletionFormat:
    """Builds ``/v1/completions`` responses and stream chunks."""

    object_name = "text_completion"

    def __init__(self, request_id: str, model: str, return_token_ids: bool = False):
        self.id, self.model, self.created, self.return_token_ids = request_id, model, now(), return_token_ids

    def _chunk(self, choices: list[dict], usage: UsageInfo | None = None) -> dict:
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage.model_dump() if usage is not None else None}

    def _stream_choice(self, index, text, token_ids, finish, logprobs=None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                "token_ids": list(token_ids) if self.return_token_ids else None}

    def start(self, indices) -> list[dict]:
        return []

    def chunk(self, items, usage: UsageInfo | None = None) -> dict:
        return self._chunk([self._stream_choice(*it) for it in items], usage)

    def usage_chunk(self, usage: UsageInfo) -> dict:
        return self._chunk([], usage)

    def response(self, items, usage: UsageInfo, prompt_logprobs: dict | None = None) -> dict:
        prompt_logprobs = prompt_logprobs or {}
        choices = [CompletionChoice(index=i, text=text, finish_reason=finish, logprobs=logprobs,
                                    token_ids=list(ids) if self.return_token_ids else None,
                                    prompt_logprobs=prompt_logprobs.get(i))
                   for i, text, ids, finish, logprobs in items]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=usage).model_dump()


class ChatFormat(CompletionFormat):
    """Builds ``/v1/chat/completions`` responses and stream chunks (the first chunk carries the role)."""

    object_name = "chat.completion.chunk"

    def start(self, indices) -> list[dict]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in indices])]

    def _stream_choice(self, index, text, token_ids, finish, logprobs=None) -> dict:
        return {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": finish,
                "token_ids": list(token_ids) if self.return_token_ids else None}

    def response(self, items, usage: UsageInfo, prompt_logprobs: dict | None = None) -> dict:
        choices = [ChatChoice(index=i, message=AssistantMessage(content=text), finish_reason=finish,
                              logprobs=logprobs, token_ids=list(ids) if self.return_token_ids else None)
                   for i, text, ids, finish, logprobs in items]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=usage).model_dump()
