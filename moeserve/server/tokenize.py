"""vLLM's ``/tokenize`` and ``/detokenize`` routes, answered in the front end with the model's tokenizer.

``POST /tokenize`` takes ``{"prompt": str}`` or ``{"messages": [...]}`` (through the chat template) and
``add_special_tokens`` (default true for a prompt, false for messages, as vLLM); it answers ``{"count",
"max_model_len", "tokens", "token_strs"}``. ``POST /detokenize`` takes ``{"tokens": [...]}`` and answers
``{"prompt": str}``.
"""
from __future__ import annotations

from fastapi import Depends, FastAPI

from moeserve.server.protocol import APIError, DetokenizeRequest, TokenizeRequest, template_messages


def add_tokenizer_routes(app: FastAPI, state, authorize) -> None:
    """``state``: the app's ``ServerState``; ``authorize``: the API-key dependency."""

    def need_tokenizer(param: str):
        if state.tokenizer is None:
            raise APIError.bad_param(param, f"{param}: this model has no tokenizer")
        return state.tokenizer

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError.bad_param(None, "give exactly one of prompt and messages")
        if body.messages is not None:
            need_tokenizer("messages")
            ids = state.chat_prompt(template_messages(body.messages), body.add_generation_prompt,
                                    add_special_tokens=bool(body.add_special_tokens),
                                    **(body.chat_template_kwargs or {}))
        else:
            tok = need_tokenizer("prompt")
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tok.encode(body.prompt, add_special_tokens=add)
        strs = state.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        tok = need_tokenizer("tokens")
        if any(not 0 <= t < state.vocab_size for t in body.tokens):
            raise APIError.bad_param("tokens", f"tokens: every token id must be in [0, {state.vocab_size})")
        return {"prompt": tok.decode(body.tokens)}
