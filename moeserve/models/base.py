"""What every block of a model is made of: the operator backends it computes with (``Ops``), the checkpoint
tensors it lists (``Entry``), and the linear layer (high precision or block-FP8, column- or row-parallel)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from moeserve.models.parallel import Shard
from moeserve.ops.interfaces import (ActivationBackend, AttentionBackend, LinearBackend, MoEBackend, NormBackend,
                                     RopeBackend, RoutingBackend)
from moeserve.ops.parallel import Parallel
from moeserve.quant.fp8 import FP8_DTYPE, block_scale_shape


@dataclass
class Ops:
    """The backend instances one engine uses; ``attention`` is set once the KV cache exists."""

    linear: LinearBackend
    norm: NormBackend
    activation: ActivationBackend
    moe: MoEBackend
    rope_cls: type[RopeBackend]
    routing: RoutingBackend | None = None  # installs each MoE block's router (moeserve.ops.moe.routing)
    attention: AttentionBackend | None = None
    names: dict[str, str] = field(default_factory=dict)
    quantization: str = "none"  # weight format of the quantisable layers: none | fp8
    # A side CUDA stream the shared expert runs on, overlapped with routing and the routed experts, for steps
    # of at most ``side_stream_max_tokens`` tokens (vLLM's shared-experts stream); None: one stream.
    side_stream: torch.cuda.Stream | None = None
    side_stream_max_tokens: int = 0
    # The MoE combine adds the block's output to the residual and applies the next norm (``moe_fuse_norm``) in steps
    # of at most this many tokens, where the MoE backend can (``MoEBackend.fuses_norm``); 0 none ...
    moe_fuse_norm_max_tokens: int = 0
    # ... and in one-token steps that route in the fused MoE's grid (``moe_fuse_norm_in_grid``)
    moe_fuse_norm_in_grid: bool = False
    # Small steps fold the post-attention residual add and norm into the router's split-K partial sums
    # (``router_fuse_norm``) where the router can.
    router_fuse_norm: bool = False
    # One-token steps that run a fused shared expert in the Triton MoE start its pieces' tiles while the routing
    # runs (``moe_fused_shared_early``).
    moe_fused_shared_early: bool = False
    # One-token steps run the router and routing in the fused MoE's first grid (``moe_route_in_grid``).
    moe_route_in_grid: bool = False
    parallel: Parallel = field(default_factory=Parallel)  # this rank's place among the GPUs (one rank: no split)


@dataclass
class Entry:
    """One checkpoint tensor: where it goes (``param[index]``) and which other names it stands for;
    ``scale`` is the block-scale parameter when ``param`` is FP8; ``shard`` the part of the tensor this rank
    reads (None: all of it). ``param`` None: the tensor belongs to another rank (an expert it holds)."""

    param: torch.Tensor | None
    index: tuple = ()
    covers: tuple[str, ...] = ()
    scale: torch.Tensor | None = None
    shard: Shard | None = None


def tp_shard(ops: Ops, dim: int) -> Shard | None:
    """An even split of a checkpoint dimension over the tensor-parallel ranks (None on one rank)."""
    p = ops.parallel
    return Shard(dim, p.tp_rank, p.tp_size) if p.is_parallel else None


def empty_param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def is_fp8_ops(ops: Ops) -> bool:
    return ops.quantization == "fp8"


class Linear(nn.Module):
    """``y = x W^T + b``; with ``quantize`` and FP8 ops, ``W`` is e4m3 with 128x128 block scales and the FP8
    path of the linear backend runs it (the bias stays in the model dtype)."""

    def __init__(self, ops: Ops, in_features: int, out_features: int, bias: bool, dtype, device,
                 quantize: bool = False, reduce: bool = False):
        super().__init__()
        self.ops = ops
        # row-parallel: each rank multiplies its slice of the input features; the partial sums are all-reduced
        # (the bias is added once, by the first rank)
        self.reduce = ops.parallel if reduce and ops.parallel.is_parallel else None
        fp8 = quantize and is_fp8_ops(ops)
        self.weight = empty_param((out_features, in_features), FP8_DTYPE if fp8 else dtype, device)
        self.weight_scale_inv = empty_param(block_scale_shape(out_features, in_features), torch.float32,
                                       device) if fp8 else None
        self.bias = empty_param((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.reduce is None or self.reduce.is_first else None
        if self.weight_scale_inv is not None:
            y = self.ops.linear.linear_fp8(x, self.weight, self.weight_scale_inv, bias)
        else:
            y = self.ops.linear.linear(x, self.weight, bias)
        return y if self.reduce is None else self.reduce.all_reduce(y)


def keep_in_high_precision(model: nn.Module, keep, dtype, device) -> list[str]:
    """Turn the FP8 linears of ``model`` whose checkpoint module names ``keep`` selects into ``dtype``
    linears (before weights are loaded or drawn); returns those names. A merged linear (q/k/v, gate/up) is
    kept whole, so its parts must be selected all or none; routed experts cannot be kept."""
    from moeserve.quant.config import QuantizationError
    parts: dict[int, list[str]] = {}
    for name, entry in model.checkpoint_entries().items():
        if entry.scale is not None and name.endswith(".weight"):
            parts.setdefault(id(entry.param), []).append(name.removesuffix(".weight"))
    linears = {id(m.weight): m for m in model.modules() if isinstance(m, Linear)}
    kept = []
    for pid, names in parts.items():
        chosen = [n for n in names if keep(n)]
        if not chosen:
            continue
        lin = linears.get(pid)
        if lin is None:
            raise QuantizationError(f"config.json quantization_config keeps {chosen[0]} in high precision; moeserve "
                                    "runs routed experts in FP8 only (their layers are stored and run as one tensor)")
        if len(chosen) != len(names):
            raise QuantizationError(
                f"config.json quantization_config keeps {', '.join(chosen)} in high precision but not "
                f"{', '.join(n for n in names if n not in chosen)}; moeserve runs them as one merged linear, so "
                "a checkpoint must keep all of them or none")
        lin.weight = empty_param(tuple(lin.weight.shape), dtype, device)
        lin.weight_scale_inv = None
        kept += names
    return kept
