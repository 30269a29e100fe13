"""What the HTTP handlers share: the engine client, the tokenizer and the model's limits (from the engine core),
the chat template, the request defaults, the served name, the key, the start time."""
from __future__ import annotations

from moeserve.engine.requests import RequestError, RequestLimits
from moeserve.engine.tokenizer import (
    TokenTexts, apply_chat_template, generation_defaults, load_chat_template, load_tokenizer,
)
from moeserve.server.engine_client import EngineClient
from moeserve.server.protocol import APIError, now


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
