"""Tile configurations for the fused-MoE Triton kernel: tuned JSON files per (shape, dtype, device) and a
default heuristic for shapes without one.

A tuned file maps a token count ``M`` to a config dict with the keys ``BLOCK_SIZE_M``, ``BLOCK_SIZE_N``,
``BLOCK_SIZE_K``, ``GROUP_SIZE_M``, ``num_warps`` and ``num_stages``. Files live in the ``configs/``
directory next to this module; the directory named by ``MOESERVE_MOE_CONFIG_DIR``, when set, is searched
first.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
CONFIG_DIR_ENV = "MOESERVE_MOE_CONFIG_DIR"
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dtype_name(dtype: torch.dtype | str) -> str:
    """The short dtype tag used in config file names: ``bf16``, ``fp16`` or ``fp32``."""
    if isinstance(dtype, str):
        return dtype
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"no fused-MoE config dtype tag for {dtype}") from None


@functools.lru_cache(maxsize=None)
def device_name() -> str:
    """The current CUDA device's name with spaces replaced by underscores (``NVIDIA_H200``), or ``cpu``."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "_")
    return "cpu"


def config_file_name(E: int, N: int, H: int, dtype: str, device: str, block_shape: list[int] | None = None) -> str:
    """Name of the tuned-config file for ``E`` experts, intermediate size ``N`` and hidden size ``H``.

    For example ``E=60,N=1408,H=2048,device_name=NVIDIA_H200,dtype=bf16.json``.
    """
    block = f",block_shape=[{','.join(str(b) for b in block_shape)}]" if block_shape else ""
    return f"E={E},N={N},H={H},device_name={device},dtype={dtype_name(dtype)}{block}.json"


def _search_dirs() -> list[Path]:
    dirs = []
    env = os.environ.get(CONFIG_DIR_ENV)
    if env:
        dirs.append(Path(env))
    dirs.append(CONFIG_DIR)
    return dirs


def parse_configs(raw: dict) -> dict[int, dict]:
    """Validate a tuned-config mapping (string or int keys) into ``{M: config}`` with int values."""
    out = {}
    for m, cfg in raw.items():
        missing = [k for k in CONFIG_KEYS if k not in cfg]
        if missing:
            raise ValueError(f"config for M={m} lacks {missing}")
        out[int(m)] = {k: int(cfg[k]) for k in CONFIG_KEYS}
    return dict(sorted(out.items()))


@functools.lru_cache(maxsize=None)
def load_configs(E: int, N: int, H: int, dtype: str, device: str) -> dict[int, dict] | None:
    """The tuned ``{M: config}`` table for this shape, dtype and device, or ``None`` when no file exists."""
    name = config_file_name(E, N, H, dtype, device)
    for d in _search_dirs():
        path = d / name
        if path.is_file():
            with open(path) as f:
                return parse_configs(json.load(f))
    return None


def default_config(M: int, E: int, N: int, H: int, top_k: int, dtype: torch.dtype) -> dict:
    """A reasonable untuned config, chosen from the expected tokens per expert ``M * top_k / E``."""
    per_expert = M * top_k / max(E, 1)
    if per_expert <= 16:
        cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    elif per_expert <= 32:
        cfg = dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    elif per_expert <= 96:
        cfg = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=16, num_warps=4, num_stages=3)
    else:
        cfg = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=16, num_warps=8, num_stages=3)
    if dtype == torch.float32:
        cfg["BLOCK_SIZE_K"] = max(32, cfg["BLOCK_SIZE_K"] // 2)
        cfg["num_stages"] = min(cfg["num_stages"], 3)
    return cfg


@functools.lru_cache(maxsize=4096)
def _get_config(M: int, E: int, N: int, H: int, top_k: int, dtype: torch.dtype) -> tuple[dict, bool]:
    table = None
    if dtype in _DTYPE_NAMES:
        table = load_configs(E, N, H, dtype_name(dtype), device_name())
    if table:
        nearest = min(table, key=lambda m: (abs(m - M), m))
        return table[nearest], True
    return default_config(M, E, N, H, top_k, dtype), False


def get_config(M: int, E: int, N: int, H: int, top_k: int, dtype: torch.dtype) -> tuple[dict, bool]:
    """``(config, tuned)`` for ``M`` tokens: the nearest tuned ``M`` bucket when a tuned file exists for this
    shape (``N`` = intermediate size), dtype and device, else :func:`default_config` with ``tuned=False``."""
    cfg, tuned = _get_config(int(M), int(E), int(N), int(H), int(top_k), dtype)
    return dict(cfg), tuned
