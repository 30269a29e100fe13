"""FlashInfer's ``cutlass_fused_moe`` (TensorRT-LLM's grouped-GEMM MoE) as a moeserve MoE backend.

Two traps, both handled here: its first GEMM wants the *up* rows before the *gate* rows (``w31``), the
opposite of moeserve's ``w13``, so ``prepare`` swaps the halves of every expert in place (no second
copy of the weights); and it returns a list whose first element is the output.
"""
from __future__ import annotations

import torch

from moeserve.ops import flashinfer_env  # noqa: F401


def w13_to_w31_(w13: torch.Tensor) -> None:
    """Swap the gate and up halves of each expert's first weight, one expert at a time."""
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        w13[e] = torch.cat([w13[e, inter:], w13[e, :inter]], dim=0)


class FlashInferMoE:
    name = "flashinfer"

    def __init__(self, device: torch.device, dtype: torch.dtype):
        from flashinfer.fused_moe import cutlass_fused_moe
        self._fn = cutlass_fused_moe
        self.device = device

    def prepare(self, layer) -> None:
        if getattr(layer, "w13_order", "gate_up") == "gate_up":
            with torch.no_grad():
                w13_to_w31_(layer.w13.data)
            layer.w13_order = "up_gate"

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer) -> torch.Tensor:
        out = self._fn(x, topk_ids.to(torch.int32), topk_weights.to(torch.float32), layer.w13, layer.w2,
                       x.dtype, quant_scales=[])
        return out[0]
