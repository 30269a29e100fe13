"""moeserve's fused MoE Triton kernel as a MoE backend, with tuned per-shape configs.

High-precision experts run ``triton_kernels.fused_moe``; block-FP8 experts run ``fp8_triton.fused_moe_fp8``.
``prepare`` interleaves a high-precision layer's gate and up rows (``w13_order = "interleaved"``) so the first
expert GEMM writes the SwiGLU activation itself (one launch fewer per layer).
(Routing is the ``routing`` operator's: see ``moeserve.ops.moe.routing``.)
"""
from __future__ import annotations

import logging

import torch

from moeserve.ops.eager import eager
from moeserve.ops.interfaces import MoEBackend

log = logging.getLogger("moeserve")


class TritonMoE(MoEBackend):
    name = "triton"
    serves_fp8 = True
    fuses_norm = True  # experts(..., add_norm=...) folds the next norm into the combine (bf16/fp16 experts)

    def __init__(self, device: torch.device, dtype: torch.dtype):
        from moeserve.ops.moe import fp8_triton, triton_configs, triton_kernels
        self._kernels = triton_kernels
        self._fp8 = fp8_triton
        self._configs = triton_configs
        self.device = device
        self.dtype = dtype
        self.untuned: set[tuple] = set()
        self.pairwise_max_tokens = 0  # steps of at most this many tokens skip the alignment (bf16/fp16 experts)
        self._sync: dict[torch.device, torch.Tensor] = {}  # routed_moe_triton's flags, one per device

    def prepare(self, layer) -> None:
        if layer.w13_scale_inv is None and layer.w13_order == "gate_up":
            layer.w13.data = self._kernels.interleave_gate_up(layer.w13.data)
            layer.w13_order = "interleaved"
        e, two_i, h = layer.w13.shape
        e -= layer.fused_shared  # a fused shared expert's pieces are not in the tuned tables' expert count
        fp8 = layer.w13_scale_inv is not None
        shape = (e, two_i // 2, h, fp8)
        if shape in self.untuned:
            return
        if fp8:
            _, tuned = self._fp8.get_fp8_config(1, e, two_i // 2, h, layer.top_k)
        else:
            _, tuned = self._configs.get_config(1, e, two_i // 2, h, layer.top_k, self.dtype)
        if not tuned:
            self.untuned.add(shape)
            kind = "fp8_w8a8 block [128,128]" if fp8 else str(self.dtype).removeprefix("torch.")
            log.warning("triton MoE: no tuned config for E=%d N=%d H=%d %s on %s; using the default heuristic",
                        e, two_i // 2, h, kind, self._configs.device_name())

    @eager  # a custom kernel launch: torch.compile (torch_compile: true) runs it eagerly
    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer,
                shared=None, add_norm=None) -> torch.Tensor:
        masked = getattr(layer, "expert_ep", (1, 0))[0] > 1  # ids of other ranks' experts are -1
        if layer.w13_scale_inv is not None:
            out = self._fp8.fused_moe_fp8(x, layer.w13, layer.w13_scale_inv, layer.w2, layer.w2_scale_inv,
                                          topk_weights, topk_ids, shared=shared, masked_ids=masked)
            return out if add_norm is None else add_norm.apply(out)  # (SparseMoE does not ask for FP8 experts)
        config, early = None, 0
        if layer.fused_shared:
            config = self._routed_config(layer, x.shape[0], x.dtype) if x.shape[0] else None
            if layer.ops.moe_fused_shared_early and layer.fuses_shared(x.shape[0]):  # its pieces: the ids' tail
                early = layer.fused_shared
        return self._kernels.fused_moe(x, layer.w13, layer.w2, topk_weights, topk_ids, config=config, shared=shared,
                                       masked_ids=masked, pairwise_max_tokens=self.pairwise_max_tokens,
                                       interleaved=layer.w13_order == "interleaved", add_norm=add_norm,
                                       fixed_tail=early)

    def _routed_config(self, layer, tokens: int, dtype: torch.dtype) -> dict:
        """The tile config of ``layer``'s experts for ``tokens``: the routed experts' table (E without a fused shared
        expert's pieces, top-k), which serves the experts extended by those pieces too."""
        e, two_i, h = layer.w13.shape
        return self._configs.get_config(tokens, e - layer.fused_shared, two_i // 2, h, layer.top_k, dtype)[0]

    def takes_routing(self, x: torch.Tensor, layer) -> bool:
        """Whether :meth:`experts_routed` takes this one-token step of ``layer`` (``moe_route_in_grid``)."""
        from moeserve.ops.moe.routed_moe_triton import unsupported_reason
        c = layer.routing
        return (x.shape[0] == 1 and self.pairwise_max_tokens >= 1 and layer.w13_order == "interleaved"
                and layer.fuses_shared(1) and layer.fused_rest is None and layer.w13_scale_inv is None
                and unsupported_reason(x, layer.gate.weight, layer.w13, layer.num_experts, c.top_k, c.method,
                                       layer.fused_shared, layer.shared_gate_in_router) is None)

    @eager
    def experts_routed(self, x: torch.Tensor, layer, add_norm=None) -> torch.Tensor:
        """A one-token step's routing and experts (``takes_routing``), the routing inside the first expert GEMM's
        grid (``routed_moe_triton.fused_moe_routed``)."""
        from moeserve.ops.moe.routed_moe_triton import fused_moe_routed, new_sync
        config = self._routed_config(layer, 1, x.dtype)
        sync = self._sync.get(x.device)
        if sync is None:
            sync = self._sync[x.device] = new_sync(x.device)
        c = layer.routing
        out, _, _, _ = fused_moe_routed(x, layer.gate.weight, layer.w13, layer.w2, layer.num_experts, c.top_k, c.method,
                                        c.renormalize, layer.fused_shared, layer.shared_gate_in_router, config, sync,
                                        add_norm=add_norm)
        return out
