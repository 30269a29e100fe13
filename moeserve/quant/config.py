"""Which weight format an engine runs: the engine's ``quantization`` field and the checkpoint's
``config.json`` ``quantization_config`` together.

A checkpoint stored as FP8 with 128x128 block scales (``quantization_config: {quant_method: fp8,
weight_block_size: [128, 128]}``, the DeepSeek-V3 / Qwen3-FP8 layout) implies ``quantization: fp8``; setting
``quantization: none`` explicitly for such a checkpoint, or pointing the engine at any other stored
quantisation, is an error that names the field.

Such a checkpoint may keep some linears in high precision: vLLM's ``ignored_layers`` names them exactly
(``model.layers.0.mlp.down_proj``), transformers' ``modules_to_not_convert`` by substring (``self_attn``).
"""
from __future__ import annotations

from moeserve.config import ConfigError

SUPPORTED_BLOCK = [128, 128]


class QuantizationError(ConfigError):
    """A quantisation setting moeserve cannot serve; the message names the field."""


def checkpoint_quantization(hf: dict) -> str:
    """``"fp8"`` when ``config.json`` declares a block-FP8 checkpoint, ``"none"`` when it declares nothing.

    Raises :class:`QuantizationError` for a declared format moeserve does not load (another method, another
    block size, static activation scales, e5m2).
    """
    qc = hf.get("quantization_config")
    if qc is None:
        return "none"
    if not isinstance(qc, dict):
        raise QuantizationError(f"config.json quantization_config must be a mapping, not {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise QuantizationError(
            f"config.json quantization_config.quant_method {method!r} is not supported; moeserve loads FP8 "
            f"checkpoints with {SUPPORTED_BLOCK[0]}x{SUPPORTED_BLOCK[1]} block scales (quant_method 'fp8', "
            f"weight_block_size {SUPPORTED_BLOCK})")
    block = qc.get("weight_block_size")
    if block is None or list(block) != SUPPORTED_BLOCK:
        raise QuantizationError(
            f"config.json quantization_config.weight_block_size {block!r} is not supported; moeserve loads FP8 "
            f"weights with block scales of {SUPPORTED_BLOCK} (per-tensor FP8 checkpoints are not supported)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise QuantizationError(f"config.json quantization_config.activation_scheme {scheme!r} is not supported; "
                                "moeserve quantises activations dynamically (per token, per 128 channels)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"config.json quantization_config.fmt {fmt!r} is not supported; only e4m3")
    return "fp8"


def resolve_quantization(requested: str, hf: dict, explicitly_set: bool = True) -> str:
    """The weight format to run: the checkpoint's when it declares one, else ``requested``.

    ``explicitly_set`` says whether the engine config set ``quantization`` itself (rather than leaving the
    default); an explicit ``none`` for an FP8 checkpoint is a mismatch.
    """
    stored = checkpoint_quantization(hf)
    if stored == "none":
        return requested
    if requested != stored and explicitly_set:
        raise QuantizationError(
            f"quantization: {requested!r} does not match the checkpoint, whose config.json declares "
            f"quantization_config.quant_method {stored!r} with {SUPPORTED_BLOCK[0]}x{SUPPORTED_BLOCK[1]} block "
            f"scales; set quantization: {stored} or leave it unset")
    return stored


def engine_quantization(cfg, hf: dict) -> str:
    """:func:`resolve_quantization` for an ``EngineConfig``."""
    return resolve_quantization(cfg.quantization, hf, "quantization" in cfg.model_fields_set)


def high_precision_rule(hf: dict):
    """``keep(module_name) -> bool``: whether the FP8 checkpoint keeps that linear in high precision (its
    ``quantization_config`` ``ignored_layers``, exact names, and ``modules_to_not_convert``, substrings)."""
    qc = hf.get("quantization_config") or {}
    lists = {}
    for key in ("ignored_layers", "modules_to_not_convert"):
        v = qc.get(key) or []
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
            raise QuantizationError(f"config.json quantization_config.{key} must be a list of module names")
        lists[key] = tuple(v)
    exact, parts = frozenset(lists["ignored_layers"]), lists["modules_to_not_convert"]
    return lambda name: name in exact or any(p in name for p in parts)
