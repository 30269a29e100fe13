"""The interface of each operator family: what the model and the runner call, and the capabilities a
backend declares (class attributes, read directly; nothing is probed with ``getattr``).

Every backend of ``moeserve.backends.SPECS`` subclasses the interface of its operator; a test checks it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


class AttentionBackend(ABC):
    """Paged attention over ``moeserve.ops.kv_cache.KVCache``: ``begin`` once per step (outside any CUDA graph),
    then ``forward`` in every layer."""

    name: ClassVar[str]
    supports_graphs: ClassVar[bool] = False  # decode steps can be captured (init_graph / begin_graph)
    # ``forward_qkv`` takes the QKV projection whole (q/k norm, rotary embedding and KV append in one kernel);
    # a backend that can sets ``fuse_qkv`` on its instances (the engine's ``attention_fused_qkv`` may clear it)
    fuse_qkv: bool = False
    # piecewise CUDA graphs: while ``split`` (``moeserve.ops.attention.AttentionSplit``) is set, ``forward_qkv``
    # writes q into its buffer and returns ``split.attend(layer, q)`` instead of attending; ``run_layer`` attends
    split = None

    @property
    def supports_piecewise(self) -> bool:
        """Whether steps can be captured in pieces around the attention (``split``, ``run_layer``)."""
        return False

    def run_layer(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured in pieces")

    def takes_layer_kernel(self, tokens: int) -> bool:
        """Whether this step runs a layer's attention half in one kernel (``attention_half``; a backend that can
        overrides both)."""
        return False

    @abstractmethod
    def begin(self, inp) -> None:
        """Plan the step described by ``inp`` (``moeserve.ops.attention.AttentionInputs``)."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append ``k``/``v`` to the cache and attend: q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""

    def forward_qkv(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
        """``forward`` from the QKV projection ``[T, (Hq + 2 Hkv) * D]``: per-head q/k RMSNorm (weights, or
        None), neox rotary embedding from the float32 ``cos_sin`` cache ``[positions, rotary_dim]``, append,
        attend -> ``[T, Hq, D]``. Only where ``fuse_qkv``."""
        raise NotImplementedError(f"attention backend {self.name!r} does not take the QKV projection whole")

    def forward_qkv_gemv(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         positions: torch.Tensor, cos_sin: torch.Tensor, q_norm: torch.Tensor | None,
                         k_norm: torch.Tensor | None, eps: float) -> torch.Tensor | None:
        """:meth:`forward_qkv` of the projection ``x @ weight^T (+ bias)``, the projection and the attention in one
        launch, or None where this backend does not run this step so (the caller projects, then
        :meth:`forward_qkv`)."""
        return None

    def init_graph(self, batch_size: int, max_pages_per_seq: int) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured in CUDA graphs")

    def graph_variants(self, batch_size: int) -> tuple[str, ...]:
        """The decode graphs to capture for ``batch_size``, one per label (a backend that runs some steps of
        that size through other kernels, as chosen in ``begin_graph``, names each way)."""
        return ("",)

    def begin_graph(self, batch_size: int, inp, variant: str | None = None, copies: list | None = None) -> str:
        """Plan a captured decode step of ``batch_size`` (``inp`` padded to it) and return which of
        ``graph_variants`` it replays; ``variant`` given (at capture) is the one to set up. ``copies``: a list the
        backend appends ``(source, fixed buffer)`` pairs of 1-d int32 device tensors to, copies into the graph's
        buffers it leaves to the caller (made before the replay, in the caller's own launch); None: it makes them."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured in CUDA graphs")


class MoEBackend(ABC):
    """The routed experts of a sparse MoE block."""

    name: ClassVar[str]
    serves_fp8: ClassVar[bool] = False  # runs block-FP8 experts itself (else the torch FP8 reference does)
    # experts(..., add_norm=AddNorm) adds its output to the residual and returns the next norm (moe_fuse_norm)
    fuses_norm: ClassVar[bool] = False
    # Takes global expert ids and the layer's ``expert_ep`` (size, rank) itself; else, with experts split
    # across ranks, ``experts`` gets local ids, -1 for experts of other ranks, which must count as zero.
    maps_expert_ids: ClassVar[bool] = False

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype

    def prepare(self, layer) -> None:
        """Once per MoE layer after its weights are loaded (re-layout, config lookup)."""

    @abstractmethod
    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer,
                shared=None) -> torch.Tensor:
        """``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` for ``x`` ``[T, H]``, plus the shared expert's output
        when ``shared`` (a ``moeserve.ops.moe.combine.SharedExpertOutput``) is given."""

    def takes_routing(self, x: torch.Tensor, layer) -> bool:
        """Whether ``experts_routed(x, layer, add_norm)`` computes this step's routing with its experts
        (``moe_route_in_grid``); False: the layer routes first."""
        return False


class RoutingBackend(ABC):
    """Installs each MoE layer's router (``layer.router``: a fused kernel, or None for torch routing)."""

    name: ClassVar[str]

    def __init__(self, device: torch.device, explicit: bool = False):
        self.device, self.explicit = torch.device(device), explicit

    @abstractmethod
    def prepare(self, layer) -> None:
        ...


class LinearBackend(ABC):
    name: ClassVar[str]

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        ...

    @abstractmethod
    def linear_fp8(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """e4m3 ``weight`` with float32 128x128 block scales."""

    def linear_argmax(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(y, y.argmax(-1))`` of ``y = linear(x, weight)`` (an LM head's logits and greedy tokens, int64) where the
        backend finds the argmax as it computes ``y`` (in the linear's epilogue, not in a pass over ``y``); ``(y,
        None)`` otherwise."""
        return self.linear(x, weight), None


class SamplingBackend(ABC):
    """Picks one token per row of float32 logits ``[B, V]`` (``moeserve.ops.sampling.SamplingBatch``).

    The sampler owns the random state: a seeded row draws from its request's own stream, kept under the
    request's key until ``release`` drops it."""

    name: ClassVar[str]

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device

    @abstractmethod
    def sample(self, logits: torch.Tensor, batch) -> torch.Tensor:
        ...

    def release(self, keys) -> None:
        """Forget the random streams of these requests (they finished)."""


class NormBackend(ABC):
    name: ClassVar[str]

    @abstractmethod
    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ...

    @abstractmethod
    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` becomes the new residual; returns (rmsnorm(new residual), new residual)."""

    def embed_rmsnorm(self, ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rmsnorm(table[ids]) * weight, table[ids])`` in one kernel (a step's embedding and its first norm), or
        None where this backend runs them apart."""
        return None


class RopeBackend(ABC):
    name: ClassVar[str]

    @abstractmethod
    def __init__(self, head_dim: int, rotary_dim: int, cos_sin_cache: torch.Tensor):
        ...

    @abstractmethod
    def apply(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...


class ActivationBackend(ABC):
    name: ClassVar[str]

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[..., :d]) * x[..., d:]``."""


INTERFACES: dict[str, type] = {
    "attention": AttentionBackend, "moe": MoEBackend, "routing": RoutingBackend, "linear": LinearBackend,
    "sampling": SamplingBackend, "norm": NormBackend, "rope": RopeBackend, "activation": ActivationBackend,
}
