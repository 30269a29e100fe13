"""How a model routes tokens to experts: plain data, read by the model architectures without importing the
routing kernels (or torch.compile's machinery they load); and the router GEMM's partial sums that pass from the
model to the routing kernel."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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


@dataclass
class RouterPartials:
    """The router GEMM's partial sums over slices of ``K`` (``routing_triton.router_partials``): ``parts
    [S, T, N2]`` float32 (``N2`` the ``rows`` rounded up to a power of two), added up in order by the routing
    kernel, which also writes the logits in ``dtype``."""
    parts: torch.Tensor
    rows: int
    dtype: torch.dtype
