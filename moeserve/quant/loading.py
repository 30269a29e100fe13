"""Putting checkpoint tensors into a model whose linear weights are block-FP8.

A model's FP8 parameter is ``float8_e4m3fn`` ``[N, K]`` (dense) or ``[E, N, K]`` (stacked experts) with a
float32 block-scale parameter ``[.., ceil(N/128), ceil(K/128)]``. Checkpoint tensors land in row ranges of
one matrix (``q_proj`` in rows ``[0, q)`` of ``qkv_proj``, ``up_proj`` of expert 3 in rows ``[I, 2I)`` of
``w13[3]``), so:

- an FP8 checkpoint tensor and its ``weight_scale_inv`` are copied into place; its row range must start on a
  128-row block boundary and end on one (or at the end of the matrix), as in every real FP8 checkpoint;
- a high-precision tensor is quantised on arrival when its rows are block-aligned (identical to quantising
  the merged matrix, since no 128x128 block straddles two tensors), and otherwise staged until every row of
  its matrix has arrived, then the whole matrix is quantised at once.
"""
from __future__ import annotations

import torch

from moeserve.quant.fp8 import BLOCK, FP8_DTYPE, block_dequant_fp8, block_quant_fp8, block_scale_shape

SCALE_SUFFIX = "_scale_inv"


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def _rows(index, n: int) -> tuple[int, int]:
    s = index if isinstance(index, slice) else slice(None)
    start, stop, step = s.indices(n)
    if step != 1:
        raise ValueError("FP8 weights only take contiguous row ranges")
    return start, stop


def units(param: torch.Tensor, index: tuple) -> list[tuple[int | None, int, int]]:
    """The ``(expert or None, row0, row1)`` matrices a checkpoint tensor covers in ``param[index]``."""
    if param.dim() == 2:
        return [(None, *_rows(index[0] if index else slice(None), param.shape[0]))]
    n = param.shape[1]
    if not index:
        return [(e, 0, n) for e in range(param.shape[0])]
    rows = _rows(index[1] if len(index) > 1 else slice(None), n)
    return [(int(index[0]), *rows)]


def _matrix(t: torch.Tensor, unit: int | None) -> torch.Tensor:
    return t if unit is None else t[unit]


def aligned(r0: int, r1: int, n: int, block: int = BLOCK) -> bool:
    return r0 % block == 0 and (r1 % block == 0 or r1 == n)


class Fp8Placer:
    """Loads high-precision or FP8 checkpoint tensors into FP8 parameters (and FP8 ones into high precision)."""

    def __init__(self):
        self._staged: dict[tuple[int, int | None], dict] = {}

    # --- FP8 checkpoint tensors -----------------------------------------------------------------
    def place_fp8(self, name: str, param: torch.Tensor, scale: torch.Tensor, index: tuple,
                  q: torch.Tensor, s: torch.Tensor, scale_name: str) -> None:
        """Copy an FP8 checkpoint tensor ``q`` and its block scales ``s`` into ``param[index]`` / ``scale``."""
        us = units(param, index)
        qs = [q] if len(us) == 1 and q.dim() == 2 else list(q)
        ss = [s] if len(us) == 1 and s.dim() == 2 else list(s) if s.dim() == 3 else None
        if ss is None or len(ss) != len(us):
            raise ValueError(f"checkpoint tensor {scale_name!r} has shape {list(s.shape)}, which does not fit "
                             f"{name!r} of shape {list(q.shape)}")
        for (unit, r0, r1), qm, sm in zip(us, qs, ss):
            n, k = param.shape[-2:]
            want = block_scale_shape(r1 - r0, k)
            if tuple(sm.shape) != want:
                raise ValueError(f"checkpoint tensor {scale_name!r} has shape {list(s.shape)} but {name!r} of shape "
                                 f"{list(q.shape)} needs 128x128 block scales of shape {list(want)}")
            if not aligned(r0, r1, n):
                raise ValueError(f"checkpoint tensor {name!r} fills rows [{r0}, {r1}) of a merged FP8 weight; "
                                 f"FP8 tensors must start and end on {BLOCK}-row block boundaries")
            _matrix(param.data, unit)[r0:r1].copy_(qm)
            b0 = r0 // BLOCK
            _matrix(scale.data, unit)[b0:b0 + want[0]].copy_(sm.float())

    @staticmethod
    def dequantize_into(target: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
        """An FP8 checkpoint tensor loaded into a high-precision parameter slice (e.g. a layer kept in bf16)."""
        target.copy_(block_dequant_fp8(q.to(target.device), s.to(target.device), target.dtype))

    # --- high-precision checkpoint tensors --------------------------------------------------------
    def quantize_into(self, param: torch.Tensor, scale: torch.Tensor, index: tuple, w: torch.Tensor) -> None:
        """Quantise a high-precision checkpoint tensor into ``param[index]`` (staging unaligned row ranges)."""
        us = units(param, index)
        ws = [w] if len(us) == 1 and w.dim() == 2 else list(w)
        n, k = param.shape[-2:]
        for (unit, r0, r1), wm in zip(us, ws):
            wm = wm.to(param.device)
            if aligned(r0, r1, n):
                q, s = block_quant_fp8(wm)
                _matrix(param.data, unit)[r0:r1].copy_(q)
                b0 = r0 // BLOCK
                _matrix(scale.data, unit)[b0:b0 + s.shape[0]].copy_(s)
                continue
            key = (id(param), unit)
            st = self._staged.get(key)
            if st is None:
                st = self._staged[key] = {"buf": torch.zeros((n, k), dtype=torch.float32, device=param.device),
                                          "filled": torch.zeros(n, dtype=torch.bool), "param": param,
                                          "scale": scale, "unit": unit}
            st["buf"][r0:r1].copy_(wm)
            st["filled"][r0:r1] = True
            if bool(st["filled"].all()):
                q, s = block_quant_fp8(st["buf"])
                _matrix(param.data, unit).copy_(q)
                _matrix(scale.data, unit).copy_(s)
                del self._staged[key]

    def pending(self) -> int:
        """Matrices still waiting for some of their rows (their missing tensors are reported by the loader)."""
        return len(self._staged)


@torch.no_grad()
def quantize_param_(param: torch.Tensor, scale: torch.Tensor, source: torch.Tensor) -> None:
    """Quantise a whole high-precision ``source`` shaped like ``param`` into ``param`` and ``scale``, one matrix
    (one expert) at a time."""
    if param.dim() == 2:
        q, s = block_quant_fp8(source)
        param.data.copy_(q)
        scale.data.copy_(s)
        return
    for e in range(param.shape[0]):
        q, s = block_quant_fp8(source[e])
        param.data[e].copy_(q)
        scale.data[e].copy_(s)
