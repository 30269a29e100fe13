"""Expert routing: which experts each token goes to, and with what weight (torch reference, any device).

Three schemes:
- ``softmax``: softmax over all experts, top-k, optionally renormalised over the k (Qwen, Mixtral).
- ``deepseek_v3``: sigmoid scores plus a per-expert correction bias choose the experts, limited to the
  best ``topk_group`` of ``n_group`` groups (a group scores the sum of its two best biased scores); the
  weights are the unbiased sigmoid scores of the chosen experts, renormalised, times
  ``routed_scaling_factor`` (DeepSeek-V3, GLM-4.5).
- ``llama4``: top-k on the raw logits; the weight is the sigmoid of the chosen logit (Llama 4).

All return ``(weights float32 [T, k], ids int32 [T, k])``.

On a GPU each scheme also runs as one fused kernel: DeepSeek-V3 routing through FlashInfer's
``fused_topk_deepseek`` (``FusedDeepseekRouter``), softmax and Llama-4 routing through moeserve's Triton
kernel (``routing_triton.TritonTopkRouter``). These are the two backends of the ``routing`` operator: ``fused``
installs the fused router on each MoE layer (``FusedRouting.prepare``) when the kernel's limits allow
(with ``auto``, a layer it cannot serve keeps torch routing and the reason is logged; named explicitly, it
is refused), and ``torch`` keeps the torch functions here, which stay the reference.
"""
from __future__ import annotations

import logging

import torch

from moeserve.ops.eager import eager
from moeserve.ops.interfaces import RoutingBackend
from moeserve.ops.moe.routing_config import RoutingConfig  # noqa: F401  (its home before; imported from here)

log = logging.getLogger("moeserve")


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def deepseek_v3_topk(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                     topk_group: int, routed_scaling_factor: float, renormalize: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.sigmoid(logits.float())
    biased = scores + correction_bias.float()[None, :]
    t, e = biased.shape
    if n_group > 1:
        grouped = biased.view(t, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        keep_groups = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        expert_mask = group_mask[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)
        biased = biased.masked_fill(~expert_mask, float("-inf"))
    ids = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def llama4_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.sigmoid(values.float()), ids.to(torch.int32)


def select_experts(logits: torch.Tensor, cfg: RoutingConfig, correction_bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    if cfg.method == "softmax":
        return softmax_topk(logits, cfg.top_k, cfg.renormalize)
    if cfg.method == "deepseek_v3":
        if correction_bias is None:
            correction_bias = torch.zeros(logits.shape[-1], device=logits.device)
        return deepseek_v3_topk(logits, correction_bias, cfg.top_k, cfg.n_group, cfg.topk_group,
                                cfg.routed_scaling_factor, cfg.renormalize)
    return llama4_topk(logits, cfg.top_k)


def append_shared(weights: torch.Tensor, ids: torch.Tensor, gate_logit: torch.Tensor | None, num_experts: int,
                  pieces: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A shared expert fused into the routed experts (``SparseMoE.fuse_shared_expert``): every token also
    picks its ``pieces`` (ids ``num_experts ..``), weighted by ``sigmoid(gate_logit)`` or 1."""
    t = ids.shape[0]
    extra = torch.arange(num_experts, num_experts + pieces, dtype=ids.dtype, device=ids.device).expand(t, pieces)
    w = torch.sigmoid(gate_logit.float()) if gate_logit is not None else weights.new_ones((t, 1))
    return torch.cat([weights, w.expand(t, pieces).to(weights.dtype)], 1), torch.cat([ids, extra], 1)


# --- DeepSeek-V3 routing on the GPU: FlashInfer's fused kernel ------------------------------------

FUSED_DEEPSEEK_CAPABILITIES = ((8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1))
FUSED_DEEPSEEK_MAX_TOPK = 8


def fused_deepseek_unsupported(cfg: RoutingConfig, num_experts: int, capability: tuple[int, int] | None
                               ) -> str | None:
    """None when ``flashinfer.fused_moe.fused_topk_deepseek`` computes ``cfg`` on a GPU of ``capability``
    (None: no GPU), else why not.

    The limits are the kernel's (``csrc/fused_moe/noAuxTcKernels.cu``): top-k <= 8; without groups at most
    384 experts; with groups at most 256 experts, one warp per group (at most 8 groups of at most 32
    experts), at most 4 chosen groups and 128 experts in them. The kernel always renormalises the chosen
    weights, so ``norm_topk_prob: false`` stays on torch. (FlashInfer's Python-side check also demands
    ``topk_group * n_group >= top_k``, which refuses ungrouped routing such as GLM-4.5's; the router calls the
    kernel with ``skip_check=True`` after this check instead.)
    """
    if cfg.method != "deepseek_v3":
        return f"routing is {cfg.method}"
    if capability is None:
        return "needs a CUDA GPU"
    cc = tuple(capability)
    if cc not in FUSED_DEEPSEEK_CAPABILITIES:
        return f"not on sm{cc[0]}{cc[1]}"
    if not cfg.renormalize:
        return "the fused kernel always renormalises the chosen weights (norm_topk_prob is false)"
    if cfg.top_k > FUSED_DEEPSEEK_MAX_TOPK:
        return f"top_k {cfg.top_k} > {FUSED_DEEPSEEK_MAX_TOPK}"
    if cfg.n_group > 1:
        per_group = num_experts // cfg.n_group
        if num_experts % cfg.n_group or cfg.topk_group > cfg.n_group or per_group * cfg.topk_group < cfg.top_k:
            return (f"n_group {cfg.n_group} / topk_group {cfg.topk_group} do not fit {num_experts} experts, "
                    f"top-{cfg.top_k}")
        if (num_experts > 256 or cfg.n_group > 8 or per_group > 32 or cfg.topk_group > 4
                or per_group * cfg.topk_group > 128):
            return (f"grouped routing over {num_experts} experts in {cfg.n_group} groups of {per_group} experts, "
                    f"{cfg.topk_group} chosen, exceeds the kernel (max 256 experts, 8 groups, 32 experts per "
                    "group, 4 chosen groups, 128 experts in them)")
    elif num_experts > 384:
        return f"{num_experts} experts without groups (max 384)"
    import importlib.util
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed"
    return None


class FusedDeepseekRouter:
    """DeepSeek-V3 routing through ``fused_topk_deepseek``: float32 scores and bias in, ``(weights float32
    [T, k], ids int32 [T, k])`` out, no host synchronisation (capturable in a CUDA graph)."""

    name = "flashinfer_fused_topk_deepseek"
    appends_shared = False  # a fused shared expert's columns are appended after it (append_shared)

    def __init__(self, cfg: RoutingConfig, num_experts: int, device: torch.device):
        from moeserve.kernel_cache import flashinfer_env  # noqa: F401  (before flashinfer: it sets its JIT env)
        from flashinfer.fused_moe import fused_topk_deepseek
        self._fn = fused_topk_deepseek
        self.cfg = cfg
        self._zero_bias = torch.zeros(num_experts, dtype=torch.float32, device=device)

    @eager  # a custom kernel launch: torch.compile (torch_compile: true) runs it eagerly
    def __call__(self, logits: torch.Tensor, correction_bias: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        scores = logits.float().contiguous()
        bias = self._zero_bias if correction_bias is None else correction_bias.float().contiguous()
        t = scores.shape[0]
        weights = torch.empty((t, c.top_k), dtype=torch.float32, device=scores.device)
        ids = torch.empty((t, c.top_k), dtype=torch.int32, device=scores.device)
        if t:
            self._fn(scores, bias, c.n_group, c.topk_group, c.top_k, c.routed_scaling_factor, weights, ids,
                     launch_with_pdl=False, skip_check=True)
        return weights, ids


def triton_topk_unsupported(cfg: RoutingConfig, num_experts: int, device: torch.device) -> str | None:
    """None when moeserve's Triton top-k kernel computes ``cfg`` on ``device``, else why not."""
    if device.type != "cuda":
        return "needs a CUDA GPU"
    import importlib.util
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    from moeserve.ops.moe.routing_triton import unsupported
    return unsupported(cfg.method, num_experts, cfg.top_k)


def gpu_router(cfg: RoutingConfig, num_experts: int, device: torch.device, split_max_tokens: int = 0):
    """``(router or None, name, reason)``: the fused router when one applies, else None (torch routing).
    ``split_max_tokens``: steps up to this many tokens may run the router's GEMM in the Triton router too."""
    device = torch.device(device)
    if cfg.method == "deepseek_v3":
        cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        why = fused_deepseek_unsupported(cfg, num_experts, cc)
        if why is not None:
            return None, "torch", why
        return FusedDeepseekRouter(cfg, num_experts, device), FusedDeepseekRouter.name, None
    why = triton_topk_unsupported(cfg, num_experts, device)
    if why is not None:
        return None, "torch", why
    from moeserve.ops.moe.routing_triton import TritonTopkRouter
    return TritonTopkRouter(cfg, split_max_tokens), TritonTopkRouter.name, None


class TorchRouting(RoutingBackend):
    """The ``torch`` routing backend: every MoE layer routes through ``select_experts``."""

    name = "torch"

    def prepare(self, layer) -> None:
        layer.router, layer.routing_impl = None, "torch"


class FusedRouting(RoutingBackend):
    """The ``fused`` routing backend: one fused top-k kernel per MoE layer (see ``gpu_router``).

    Chosen by ``auto``, a layer whose routing the kernels cannot compute keeps torch routing and the reason
    is logged once; named explicitly (``backends.routing: fused``), such a layer is refused."""

    name = "fused"

    def __init__(self, device: torch.device, explicit: bool = False):
        super().__init__(device, explicit)
        self.split_max_tokens = 0  # router_split_k_max_tokens (the engine sets it)
        self._logged: set[tuple] = set()

    def prepare(self, layer) -> None:
        from moeserve.backends import BackendUnavailable
        cfg = layer.routing
        router, name, why = gpu_router(cfg, layer.num_experts, self.device, self.split_max_tokens)
        if router is None and self.explicit:
            raise BackendUnavailable(f"backends.routing: 'fused' cannot run this model's {cfg.method} routing "
                                     f"({layer.num_experts} experts, top-{cfg.top_k}): {why}")
        layer.router, layer.routing_impl = router, name
        key = (cfg.method, name, why)
        if key not in self._logged:
            self._logged.add(key)
            log.info("routing: %s routing runs %s%s", cfg.method, name, f" ({why})" if why else "")


def flashinfer_modules(t) -> list:
    """FlashInfer's fused DeepSeek-V3 top-k, which the fused routing backend installs when the model's
    routing fits it (``fused_deepseek_unsupported`` decides). Softmax and Llama-4 routing run moeserve's Triton
    kernel, which FlashInfer does not build. ``t`` is a ``moeserve.kernel_cache.modules.Target``."""
    from moeserve.kernel_cache.modules import KernelModule
    if t.routing is None or t.routing.method != "deepseek_v3":
        return []
    if fused_deepseek_unsupported(t.routing, t.num_experts, t.arch.capability) is not None:
        return []
    return [KernelModule("routing", "routing", "fused", "fused DeepSeek-V3 top-k routing",
                         "flashinfer.jit.dsv3_optimizations:gen_dsv3_fused_routing_module", weight=10)]
