"""A tiny word-level Hugging Face tokenizer with a ChatML chat template, saved beside a tiny checkpoint.

The vocabulary is padded to exactly the model's ``vocab_size`` so every token id a random model can
produce decodes to some text.
"""
from __future__ import annotations

from pathlib import Path

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world , how are you today ?",
    "a mixture of experts model routes every token to a few experts",
    "the server streams tokens to the client as they are generated",
    "tell me a story about a robot and a cat .",
    "system user assistant",
]
SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 256, chat_template: str | None = CHAT_TEMPLATE):
    """A ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` tokens: specials, the words of
    ``SENTENCES``, single characters, then filler words ``w0``, ``w1``, ..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    words = [w for s in SENTENCES for w in s.split()]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,?!'-")
    for tok in SPECIAL_TOKENS + words + chars:
        vocab.setdefault(tok, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{i}", len(vocab))
        i += 1
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size: {vocab_size} is too small for the base vocabulary of {len(vocab)} tokens")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def make_tiny_model(path, kind: str = "qwen3_moe", vocab_size: int = 256, chat_template: str | None = CHAT_TEMPLATE,
                    seed: int = 0) -> Path:
    """A random ``kind`` checkpoint plus a tokenizer of the same vocabulary in ``path``; returns the path."""
    from hf_models import make_checkpoint

    path = Path(path)
    make_checkpoint(kind, path, seed=seed, vocab_size=vocab_size)
    build_tokenizer(vocab_size, chat_template).save_pretrained(path)
    return path
