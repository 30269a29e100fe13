"""Per-request sampling parameters, in vLLM's shape, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # vLLM's default max_logprobs


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k 0 or -1 means no top-k limit; top_p 1.0 and min_p 0.0 disable those
    filters. ``seed`` makes a sampled request reproducible regardless of what else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    detokenize: bool = True
    stop: list[str] = field(default_factory=list)
    # top-N log-probabilities of each sampled token / of each prompt token (vLLM's), N <= MAX_LOGPROBS
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.temperature is None or not (0.0 <= float(self.temperature) <= 100.0):
            bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= float(self.min_p) <= 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not (0 <= self.seed < 2**63)):
            bad("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be non-negative integers, got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", f"must be non-empty strings, got {self.stop!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (0, -1) else self.top_k
