"""Model families by Hugging Face ``model_type``; each turns a config.json into an ``ArchConfig``."""
from __future__ import annotations

from moeserve.models import glm4_moe, qwen2_moe, qwen3_moe
from moeserve.models.arch import ArchConfig

FAMILIES = {
    "glm4_moe": glm4_moe,
    "qwen2_moe": qwen2_moe,
    "qwen3_moe": qwen3_moe,
}


def arch_from_hf(hf: dict) -> ArchConfig:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; moeserve runs {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type].arch_config(hf)


def checkpoint_name(model_type: str, name: str) -> str:
    """A family's checkpoint tensor name in the shared (Qwen-style) naming."""
    rename = getattr(FAMILIES[model_type], "rename", None)
    return rename(name) if rename else name


def hf_name(model_type: str, name: str) -> str:
    """The Hugging Face checkpoint name of a tensor in the shared naming (``checkpoint_name`` reversed)."""
    export = getattr(FAMILIES[model_type], "export_name", None)
    return export(name) if export else name
