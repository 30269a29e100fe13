"""Dense linear layers: torch (cuBLAS on GPU, the reference everywhere)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchLinear:
    name = "torch"

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device = device

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)
