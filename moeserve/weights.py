"""Model weights: Hugging Face safetensors checkpoints (one file or sharded with an index) or dummy random init.

The model lists every checkpoint tensor it expects (``checkpoint_entries``); loading copies each one into
its place and checks the shape. A missing tensor or a shape mismatch is an error that names the tensor.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from moeserve.models import checkpoint_name
from moeserve.models.layers import MoECausalLM

log = logging.getLogger("moeserve")

# Checkpoint tensors that carry nothing moeserve needs.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
NORM_NAMES = ("input_layernorm", "post_attention_layernorm", "norm", "q_norm", "k_norm")


class WeightError(ValueError):
    pass


def checkpoint_files(weights_dir: str | Path) -> list[Path]:
    d = Path(weights_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({d / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise WeightError(f"{index.name} names shard(s) that are not in {d}: {', '.join(absent)}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors files in {d}")
    return files


@torch.no_grad()
def load_checkpoint(model: MoECausalLM, weights_dir: str | Path) -> dict:
    """Copy a safetensors checkpoint into ``model``; returns counts of what was loaded and skipped."""
    entries = model.checkpoint_entries()
    model_type = model.arch.model_type
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in checkpoint_files(weights_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                key = checkpoint_name(model_type, name)
                entry = entries.get(key)
                if entry is None:
                    if not key.endswith(IGNORED_SUFFIXES) and not (key == "lm_head.weight" and model.arch.tie_word_embeddings):
                        unexpected.append(name)
                    continue
                target = entry.param.data[entry.index] if entry.index else entry.param.data
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(target.shape):
                    raise WeightError(f"checkpoint tensor {name!r} has shape {list(shape)} but the model "
                                      f"({model_type}) expects {list(target.shape)}")
                target.copy_(f.get_tensor(name).to(target.dtype))
                loaded.add(key)
                loaded.update(entry.covers)
    required = {name for name, e in entries.items() if not e.covers}
    missing = sorted(required - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise WeightError(f"checkpoint in {weights_dir} lacks {len(missing)} tensor(s) the model needs: {shown}")
    if unexpected:
        log.warning("ignored %d checkpoint tensor(s) the model does not use, e.g. %s", len(unexpected), unexpected[:3])
    return {"loaded": len(loaded), "ignored": len(unexpected)}


@torch.no_grad()
def init_dummy(model: MoECausalLM, seed: int = 0, std: float | None = None) -> None:
    """Random weights of the right shapes: N(0, initializer_range) matrices, unit norms, zero biases."""
    std = model.arch.initializer_range if std is None else std
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if leaf in NORM_NAMES or parent in NORM_NAMES and leaf == "weight":
            p.fill_(1.0)
        elif leaf in ("bias", "correction_bias"):
            p.zero_()
        else:
            g = gens.get(p.device)
            if g is None:
                g = gens[p.device] = torch.Generator(device=p.device)
                g.manual_seed(seed)
            p.normal_(0.0, std, generator=g)
