"""The model's tokenizer and what goes with it, without the engine's heavy imports (the HTTP front end
uses these): loading it, the text of single tokens, the chat template (the tokenizer's, or one given as a
file or inline, as ``vllm serve --chat-template``) and the sampling defaults of ``generation_config.json``."""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from pathlib import Path

from moeserve.config import has_tokenizer_files

log = logging.getLogger("moeserve")

# generation_config.json keys applied as request defaults (vLLM's --generation-config auto) -> SamplingParams;
# max_new_tokens is the output limit of a request that sets none (the server also caps it at the context left)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "max_new_tokens": "max_tokens"}
UNSUPPORTED_GENERATION_KEYS = ("repetition_penalty",)


def load_tokenizer(config_dir: str | None):
    if not has_tokenizer_files(config_dir):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(config_dir)


class TokenTexts:
    """The text of single tokens (for log-probabilities), cached; ``token_id:N`` without a tokenizer."""

    def __init__(self, tokenizer, max_entries: int = 1 << 16):
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._cache: OrderedDict[int, str] = OrderedDict()

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is not None:
            self._cache.move_to_end(token_id)
            return text
        if self.tokenizer is None:
            text = f"token_id:{token_id}"
        else:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        self._cache[token_id] = text
        if len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return text


def load_chat_template(value: str | None) -> str | None:
    """A chat template given as a file path or inline (vLLM's rule: a value holding any of ``{}`` or a
    newline is a template, anything else must be a readable file)."""
    if value is None:
        return None
    if any(c in value for c in "{}\n"):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template: {value!r} is neither a template nor a readable file")
    return path.read_text()


def apply_chat_template(tokenizer, messages: list[dict], chat_template: str | None = None,
                        add_generation_prompt: bool = True, add_special_tokens: bool = False, **kwargs) -> list[int]:
    """The prompt token ids of ``messages`` (the template's text, tokenized without adding special tokens
    unless asked, as vLLM does). Raises ``ValueError`` when there is no tokenizer or template."""
    if tokenizer is None:
        raise ValueError("messages: this model has no tokenizer, so chat is not available; "
                         "use /v1/completions with token-id prompts")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model's tokenizer has no chat template; give one with --chat-template "
                         "or use /v1/completions")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, **kwargs)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def generation_defaults(config_dir: str | None, mode: str = "auto") -> dict:
    """Sampling defaults from ``generation_config.json``: ``auto`` reads the model directory's, ``vllm`` (or
    ``none``) uses none, anything else is a directory holding one. Only fields moeserve supports are taken."""
    if mode in ("vllm", "none"):
        return {}
    folder = config_dir if mode == "auto" else mode
    if folder is None:
        return {}
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        if mode != "auto":
            raise ValueError(f"generation_config: {str(path)!r} does not exist")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from None
    out = {GENERATION_DEFAULTS[k]: data[k] for k in GENERATION_DEFAULTS if data.get(k) is not None}
    ignored = [k for k in UNSUPPORTED_GENERATION_KEYS if data.get(k) not in (None, 1, 1.0)]
    if ignored:
        log.warning("generation_config.json: ignoring %s (not supported)", ", ".join(ignored))
    if out:
        log.info("default sampling parameters from %s: %s", path, out)
    return out
