"""RMSNorm, rotary embedding and SiLU-and-mul: a torch reference and the FlashInfer kernels for each."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.kernel_cache import flashinfer_env  # noqa: F401  (sets FlashInfer's environment before its import)
from moeserve.kernel_cache.modules import KernelModule, Target
from moeserve.ops.eager import eager
from moeserve.ops.interfaces import ActivationBackend, NormBackend, RopeBackend


# --- RMSNorm ------------------------------------------------------------------------------------

# steps that run the Triton add + RMSNorm also gather their embedding rows and apply the first norm in one kernel
# (False: F.embedding and FlashInfer's rmsnorm: an A/B switch, read when the backend is made; off until an A/B on a
# GPU has measured it)
EMBED_NORM = False


class TorchNorm(NormBackend):
    """RMSNorm as Hugging Face computes it: in float32, cast back, then scaled by the weight."""

    name = "torch"

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """``residual + x`` becomes the new residual; returns (rmsnorm(new residual), new residual)."""
        residual = residual + x
        return self.rmsnorm(residual, weight, eps), residual


class FlashInferNorm(NormBackend):
    """FlashInfer's RMSNorm kernels; the residual add + RMSNorm of steps of at most ``triton_max_tokens`` rows
    (``norm_triton_max_tokens``, set by the engine) runs :func:`moeserve.ops.norm_triton.add_rmsnorm` instead."""

    name = "flashinfer"

    def __init__(self, triton_max_tokens: int = 0):
        import flashinfer.norm as fn
        self._fn = fn
        self.triton_max_tokens = triton_max_tokens
        self.embed_norm = EMBED_NORM

    def takes_triton(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether :meth:`add_rmsnorm` of these rows runs the Triton kernel."""
        if not (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= self.triton_max_tokens):
            return False
        from moeserve.ops import norm_triton
        return norm_triton.takes(x, residual)

    @eager  # a custom kernel launch: torch.compile (torch_compile: true) runs it eagerly
    def _triton_add_rmsnorm(self, x, residual, weight, eps):
        from moeserve.ops.norm_triton import add_rmsnorm
        return add_rmsnorm(x, residual, weight, eps)

    def embed_rmsnorm(self, ids, table, weight, eps):
        """Steps of at most ``triton_max_tokens`` tokens: :func:`moeserve.ops.norm_triton.embed_rmsnorm`
        (``embed_norm``, from ``EMBED_NORM``)."""
        from moeserve.ops import norm_triton
        if not (self.embed_norm and ids.is_cuda and ids.dim() == 1 and 0 < ids.shape[0] <= self.triton_max_tokens
                and table.shape[1] <= norm_triton.MAX_HIDDEN and table.stride(1) == 1):
            return None
        return self._triton_embed_rmsnorm(ids, table, weight, eps)

    @eager
    def _triton_embed_rmsnorm(self, ids, table, weight, eps):
        from moeserve.ops.norm_triton import embed_rmsnorm
        return embed_rmsnorm(ids, table, weight, eps)

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 3:  # per-head q/k norm: FlashInfer takes (tokens, heads, dim) directly
            return self._fn.rmsnorm(x.contiguous(), weight, eps)
        return self._fn.rmsnorm(x, weight, eps)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        # In place: residual += x; x = rmsnorm(residual) * weight.
        if self.takes_triton(x, residual):
            return self._triton_add_rmsnorm(x, residual, weight, eps)
        self._fn.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual


# --- rotary embedding ---------------------------------------------------------------------------

def rope_cos_sin_cache(rotary_dim: int, max_positions: int, theta: float, scaling: dict | None = None,
                       device: torch.device | None = None) -> torch.Tensor:
    """float32 ``[max_positions, rotary_dim]``: cos in the first half of each row, sin in the second."""
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        raise ValueError(f"rope_scaling: type {scaling.get('rope_type', scaling.get('type'))!r} is not supported")
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


class TorchRope(RopeBackend):
    """Neox-style (rotate-half) RoPE over the first ``rotary_dim`` dims of each head, as HF applies it."""

    name = "torch"

    def __init__(self, head_dim: int, rotary_dim: int, cos_sin_cache: torch.Tensor):
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.cache = cos_sin_cache

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.view(t, -1, self.head_dim)
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat([-x2, x1], dim=-1)
        c = torch.cat([cos, cos], dim=-1)[:, None, :]
        s = torch.cat([sin, sin], dim=-1)[:, None, :]
        out = rot * c + rotated * s
        if rest.shape[-1]:
            out = torch.cat([out, rest], dim=-1)
        return out.reshape(t, -1)

    def apply(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cs = self.cache[positions]
        half = self.rotary_dim // 2
        cos, sin = cs[:, :half].to(q.dtype), cs[:, half:].to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


class FlashInferRope(RopeBackend):
    name = "flashinfer"

    def __init__(self, head_dim: int, rotary_dim: int, cos_sin_cache: torch.Tensor):
        import flashinfer.rope as fr
        self._fn = fr.apply_rope_with_cos_sin_cache_inplace
        self.head_dim = head_dim
        self.cache = cos_sin_cache.float().contiguous()

    def apply(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        self._fn(positions, q, k, self.head_dim, self.cache, is_neox=True)
        return q, k


# --- SiLU and mul ------------------------------------------------------------------------------

class TorchActivation(ActivationBackend):
    name = "torch"

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[:, :d]) * x[:, d:]``: the gate is the first half."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class FlashInferActivation(ActivationBackend):
    name = "flashinfer"

    def __init__(self):
        from flashinfer.activation import silu_and_mul
        self._fn = silu_and_mul

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x)


# --- the FlashInfer modules these backends load (for ahead-of-time builds) ------------------------------

def norm_modules(t: Target) -> list[KernelModule]:
    return [KernelModule("norm", "norm", "flashinfer", "RMSNorm (CUDA)", "flashinfer.jit.norm:gen_norm_module", weight=15)]


def rope_modules(t: Target) -> list[KernelModule]:
    return [KernelModule("rope", "rope", "flashinfer", "RoPE", "flashinfer.jit.rope:gen_rope_module", weight=15)]


def activation_modules(t: Target) -> list[KernelModule]:
    return [KernelModule("silu_and_mul", "activation", "flashinfer", "SiLU and mul",
                         "flashinfer.jit.activation:gen_act_and_mul_module", ("silu",), weight=3)]
