"""moeserve's fused MoE Triton kernel as a MoE backend, with tuned per-shape configs."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("moeserve")


class TritonMoE:
    name = "triton"

    def __init__(self, device: torch.device, dtype: torch.dtype):
        from moeserve.ops.moe import triton_configs, triton_kernels
        self._kernels = triton_kernels
        self._configs = triton_configs
        self.dtype = dtype
        self.untuned: set[tuple] = set()

    def prepare(self, layer) -> None:
        e, two_i, h = layer.w13.shape
        shape = (e, two_i // 2, h)
        if shape in self.untuned:
            return
        _, tuned = self._configs.get_config(1, e, two_i // 2, h, layer.top_k, self.dtype)
        if not tuned:
            self.untuned.add(shape)
            log.warning("triton MoE: no tuned config for E=%d N=%d H=%d %s on %s; using the default heuristic",
                        e, two_i // 2, h, str(self.dtype).removeprefix("torch."), self._configs.device_name())

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer) -> torch.Tensor:
        return self._kernels.fused_moe(x, layer.w13, layer.w2, topk_weights, topk_ids)
