"""The last step of a MoE block: the sum of each token's top-k expert outputs, plus the (optionally
sigmoid-gated) shared expert's output, in one pass.

``SharedExpertOutput`` carries the shared expert's result to the routed path. It may have been computed on a
side CUDA stream (``stream``), overlapped with routing and the routed experts as vLLM does for small steps;
``join`` makes the current stream wait for it before it is read.

``moe_combine`` is one Triton kernel on a GPU (it replaces ``torch.sum`` over ``[T, k, H]``, the sigmoid, the
multiply and the add: four launches per layer) and the torch reference elsewhere. It accumulates in float32
and rounds once.
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


def moe_combine(down: torch.Tensor, top_k: int, shared: SharedExpertOutput | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``down`` ``[T * k, H]`` (the routed experts' weighted outputs, token-major) -> ``[T, H]``."""
    if down.device.type == "cpu":
        return combine_reference(down, top_k, shared, out)
    from moeserve.ops.moe.combine_triton import moe_combine_triton
    if shared is None:
        return moe_combine_triton(down, top_k, out=out)
    shared.join()
    return moe_combine_triton(down, top_k, shared.out, shared.gate_logit, out)
