"""How a model routes tokens to experts: plain data, read by the model architectures without importing the
routing kernels (or torch.compile's machinery they load)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingConfig:
    method: str = "softmax"  # softmax | deepseek_v3 | llama4
    top_k: int = 2
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.method not in ("softmax", "deepseek_v3", "llama4"):
            raise ValueError(f"routing method {self.method!r} is not one of softmax, deepseek_v3, llama4")
