"""The last step of a MoE block: the sum of each token's top-k expert outputs, plus the (optionally
sigmoid-gated) shared expert's output, in one pass.

``SharedExpertOutput`` carries the shared expert's result to the routed path. It may have been computed on a
side CUDA stream (``stream``), overlapped with routing and the routed experts as vLLM does for small steps;
``join`` makes the current stream wait for it before it is read.

``moe_combine`` is one Triton kernel on a GPU (it replaces ``torch.sum`` over ``[T, k, H]``, the sigmoid, the
multiply and the add: four launches per layer) and the torch reference elsewhere. It accumulates in float32
and rounds once. Given ``add_norm`` (the residual stream, the next layer's input-norm weight, eps) it goes on
to that layer's fused add + RMSNorm in the same kernel: the residual grows by the block's output in place and
the normed input of the next layer is returned (one launch fewer per layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedExpertOutput:
    out: torch.Tensor  # [T, H] the shared expert's output, before its gate
    gate_logit: torch.Tensor | None = None  # [T, 1] logit of its sigmoid gate (Qwen2-MoE); None: ungated
    stream: torch.cuda.Stream | None = None  # the side stream it was computed on, if any

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    def gated(self) -> torch.Tensor:
        """The shared expert's contribution (joined first), in its dtype."""
        self.join()
        if self.gate_logit is None:
            return self.out
        return torch.sigmoid(self.gate_logit) * self.out

    def add_to(self, routed: torch.Tensor) -> torch.Tensor:
        return routed + self.gated()

    def padded(self, rows: int) -> SharedExpertOutput:
        """The same output with ``rows`` zero rows appended (joined first): for a step padded across ranks."""
        self.join()
        pad = lambda t: None if t is None else torch.nn.functional.pad(t, (0, 0, 0, rows))  # noqa: E731
        return SharedExpertOutput(pad(self.out), pad(self.gate_logit), None)


def combine_reference(down: torch.Tensor, top_k: int, shared: SharedExpertOutput | None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_j down[t * k + j] (+ sigmoid(g_t) * shared_t)`` computed in float32, rounded once."""
    t, h = down.shape[0] // top_k, down.shape[1]
    acc = down.view(t, top_k, h).float().sum(dim=1)
    if shared is not None:
        shared.join()
        s = shared.out.float()
        if shared.gate_logit is not None:
            s = torch.sigmoid(shared.gate_logit.float()) * s
        acc = acc + s
    if out is None:
        return acc.to(down.dtype)
    return out.copy_(acc)


@dataclass
class AddNorm:
    """What the next layer's fused add + RMSNorm needs: the residual stream (updated in place) and its norm."""
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float


def add_rmsnorm_reference(x: torch.Tensor, add_norm: AddNorm) -> torch.Tensor:
    """``residual += x`` (in place, summed in float32 and rounded), then the RMSNorm of the float32 sum times
    the weight, rounded once: FlashInfer's ``fused_add_rmsnorm``."""
    s = x.float() + add_norm.residual.float()
    add_norm.residual.copy_(s)
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + add_norm.eps) * add_norm.weight.float()
    return normed.to(x.dtype)


def moe_combine(down: torch.Tensor, top_k: int, shared: SharedExpertOutput | None = None,
                out: torch.Tensor | None = None, add_norm: AddNorm | None = None) -> torch.Tensor:
    """``down`` ``[T * k, H]`` (the routed experts' weighted outputs, token-major) -> ``[T, H]``; with
    ``add_norm``, the next layer's normed input (and the residual updated)."""
    if down.device.type == "cpu":
        combined = combine_reference(down, top_k, shared, None if add_norm else out)
        if add_norm is None:
            return combined
        normed = add_rmsnorm_reference(combined, add_norm)
        return normed if out is None else out.copy_(normed)
    from moeserve.ops.moe.combine_triton import moe_combine_add_rmsnorm_triton, moe_combine_triton
    if add_norm is not None:
        if shared is not None:
            shared.join()
        return moe_combine_add_rmsnorm_triton(down, top_k, shared.out if shared else None,
                                              shared.gate_logit if shared else None, add_norm.residual,
                                              add_norm.weight, add_norm.eps, out)
    if shared is None:
        return moe_combine_triton(down, top_k, out=out)
    shared.join()
    return moe_combine_triton(down, top_k, shared.out, shared.gate_logit, out)
