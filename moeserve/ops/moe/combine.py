"""The last step of a MoE block: the sum of each token's top-k expert outputs, plus the (optionally
sigmoid-gated) shared expert's output, in one pass.

``SharedExpertOutput`` carries the shared expert's result to the routed path. It may have been computed on a
side CUDA stream (``stream``), overlapped with routing and the routed experts as vLLM does for small steps;
``join`` makes the current stream wait for it before it is read.

``moe_combine`` is one Triton kernel on a GPU (it replaces ``torch.sum`` over ``[T, k, H]``, the sigmoid, the
multiply and the add: four launches per layer) and the torch reference elsewhere. It accumulates in float32
and rounds once.

``AddNorm`` asks the combine to finish the layer as well (``moe_fuse_norm``): add the MoE output to the
residual stream in place and return the RMS norm of the result (the next layer's input norm, or the model's
final norm), one kernel where the combine and the next norm were two.
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


@dataclass
class AddNorm:
    """``residual += moe_out`` (in place), then return ``rmsnorm(residual) * weight`` instead of ``moe_out``."""
    residual: torch.Tensor  # [T, H], updated in place
    weight: torch.Tensor  # [H] the next norm's weight
    eps: float

    def apply(self, moe_out: torch.Tensor) -> torch.Tensor:
        """The reference: FlashInfer's ``fused_add_rmsnorm`` arithmetic (the sum normalised before rounding)."""
        x = self.residual.float() + moe_out.float()
        self.residual.copy_(x)
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(moe_out.dtype)


def combine_reference(down: torch.Tensor, top_k: int, shared: SharedExpertOutput | None,
                      out: torch.Tensor | None = None, add_norm: AddNorm | None = None) -> torch.Tensor:
    """``sum_j down[t * k + j] (+ sigmoid(g_t) * shared_t)`` computed in float32, rounded once (then
    ``add_norm`` applied, when given)."""
    t, h = down.shape[0] // top_k, down.shape[1]
    acc = down.view(t, top_k, h).float().sum(dim=1)
    if shared is not None:
        shared.join()
        s = shared.out.float()
        if shared.gate_logit is not None:
            s = torch.sigmoid(shared.gate_logit.float()) * s
        acc = acc + s
    if add_norm is not None:
        acc = add_norm.apply(acc.to(down.dtype))
    if out is None:
        return acc.to(down.dtype)
    return out.copy_(acc)


def moe_combine(down: torch.Tensor, top_k: int, shared: SharedExpertOutput | None = None,
                out: torch.Tensor | None = None, add_norm: AddNorm | None = None) -> torch.Tensor:
    """``down`` ``[T * k, H]`` (the routed experts' weighted outputs, token-major) -> ``[T, H]`` (with
    ``add_norm``: the norm of the residual it was added to)."""
    if down.device.type == "cpu":
        return combine_reference(down, top_k, shared, out, add_norm)
    from moeserve.ops.moe.combine_triton import moe_combine_triton
    if shared is None:
        return moe_combine_triton(down, top_k, out=out, add_norm=add_norm)
    shared.join()
    return moe_combine_triton(down, top_k, shared.out, shared.gate_logit, out, add_norm=add_norm)
