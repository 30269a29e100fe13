"""FlashInfer's ``cutlass_fused_moe`` (TensorRT-LLM's grouped-GEMM MoE) as a moeserve MoE backend.

Two traps, both handled here: its first GEMM wants the *up* rows before the *gate* rows (``w31``), the
opposite of moeserve's ``w13``, so ``prepare`` swaps the halves of every expert in place (no second
copy of the weights); and it returns a list whose first element is the output.

Block-FP8 experts run the DeepSeek FP8 block-scale path (``use_deepseek_fp8_block_scale=True``, sm90 only,
bf16 activations quantised 1x128 inside the kernel, ``quant_scales=[fc1_scales, fc2_scales]`` of shapes
``[E, 2I/128, H/128]`` and ``[E, H/128, I/128]``); ``prepare`` swaps the gate and up *scale* blocks with the
weight rows, which needs ``I`` and ``H`` to be multiples of 128.
"""
from __future__ import annotations

import torch

from moeserve.kernel_cache import flashinfer_env  # noqa: F401
from moeserve.kernel_cache.modules import KernelModule, Target
from moeserve.ops.eager import eager
from moeserve.ops.interfaces import MoEBackend
from moeserve.quant.fp8 import BLOCK


def w13_to_w31_(w13: torch.Tensor) -> None:
    """Swap the gate and up halves of each expert's first weight, one expert at a time."""
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        w13[e] = torch.cat([w13[e, inter:], w13[e, :inter]], dim=0)


def swap_halves_(t: torch.Tensor, rows: int) -> None:
    """Swap rows ``[0, rows)`` and ``[rows, 2 rows)`` of each ``t[e]`` in place (any dtype, incl. fp8)."""
    raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    for e in range(raw.shape[0]):
        raw[e] = torch.cat([raw[e, rows:], raw[e, :rows]], dim=0)


def fp8_layout_problem(inter: int, hidden: int) -> str | None:
    """None when the FP8 block-scale CUTLASS path can take these expert sizes, else why not."""
    if inter % BLOCK or hidden % BLOCK:
        return (f"FlashInfer's FP8 block-scale MoE needs moe_intermediate_size ({inter}) and hidden_size ({hidden}) "
                f"to be multiples of {BLOCK}")
    return None


class FlashInferMoE(MoEBackend):
    """With several ranks the kernel gets the layer's split: ``tp_size/tp_rank`` (each expert's intermediate
    rows) or ``ep_size/ep_rank`` (whole experts; it takes global ids and skips those of other ranks)."""

    name = "flashinfer"
    serves_fp8 = True
    maps_expert_ids = True

    def __init__(self, device: torch.device, dtype: torch.dtype):
        from flashinfer.fused_moe import cutlass_fused_moe
        self._fn = cutlass_fused_moe
        self.device = device
        self.dtype = dtype

    def prepare(self, layer) -> None:
        scales = layer.w13_scale_inv
        if scales is not None:
            inter, hidden = layer.w2.shape[2], layer.w2.shape[1]
            why = fp8_layout_problem(inter, hidden)
            if why is None and self.dtype != torch.bfloat16:
                why = f"FlashInfer's FP8 block-scale MoE takes bfloat16 activations; dtype is {self.dtype}"
            if why is None and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) != (9, 0):
                why = "FlashInfer's FP8 block-scale MoE (use_deepseek_fp8_block_scale) runs on sm90 only"
            if why is not None:
                raise ValueError(f"backends.moe: 'flashinfer': {why}; use backends.moe: triton")
        if layer.w13_order == "gate_up":
            with torch.no_grad():
                if scales is None:
                    w13_to_w31_(layer.w13.data)
                else:
                    inter = layer.w2.shape[2]
                    swap_halves_(layer.w13.data, inter)
                    swap_halves_(scales.data, inter // BLOCK)
            layer.w13_order = "up_gate"

    @eager  # a custom kernel launch: torch.compile (torch_compile: true) runs it eagerly
    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer,
                shared=None) -> torch.Tensor:
        out = self._finalized(x, topk_weights, topk_ids, layer)
        return out if shared is None else shared.add_to(out)

    def _finalized(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer) -> torch.Tensor:
        scales = layer.w13_scale_inv
        (tp_size, tp_rank) = getattr(layer, "expert_tp", (1, 0))  # a SparseMoE block on several ranks
        (ep_size, ep_rank) = getattr(layer, "expert_ep", (1, 0))
        split = dict(tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size, ep_rank=ep_rank)
        if scales is not None:
            out = self._fn(x, topk_ids.to(torch.int32), topk_weights.to(torch.float32), layer.w13, layer.w2,
                           x.dtype, quant_scales=[scales, layer.w2_scale_inv], use_deepseek_fp8_block_scale=True,
                           **split)
            return out[0]
        out = self._fn(x, topk_ids.to(torch.int32), topk_weights.to(torch.float32), layer.w13, layer.w2,
                       x.dtype, quant_scales=[], **split)
        return out[0]


CUTLASS_MOE_GEN = {
    (8, 9): "gen_cutlass_fused_moe_sm89_module", (9, 0): "gen_cutlass_fused_moe_sm90_module",
    (10, 0): "gen_cutlass_fused_moe_sm100_module", (10, 3): "gen_cutlass_fused_moe_sm103_module",
    (11, 0): "gen_cutlass_fused_moe_sm100_module", (12, 0): "gen_cutlass_fused_moe_sm120_module",
    (12, 1): "gen_cutlass_fused_moe_sm120_module",
}


def flashinfer_modules(t: Target) -> list[KernelModule]:
    """``cutlass_fused_moe``: one module per architecture family with every dtype in it, built the FAST_BUILD
    way (see ``moeserve.tools.specs.gen_cutlass_fused_moe_fast_build``)."""
    gen = CUTLASS_MOE_GEN.get(t.arch.capability)
    if gen is None:
        return []
    return [KernelModule("fused_moe", "moe", "flashinfer", f"CUTLASS fused MoE ({t.arch.sm}, FAST_BUILD tiles)",
                         "moeserve.tools.specs:gen_cutlass_fused_moe_fast_build", (gen,), weight=100)]
