"""Writing a block-FP8 checkpoint from a high-precision one, in the DeepSeek-V3 / Qwen3-FP8 layout.

Every linear weight moeserve runs in FP8 (attention q/k/v/o, dense and shared-expert MLPs, routed experts)
becomes ``float8_e4m3fn`` ``<name>`` plus float32 ``<name>_scale_inv`` (128x128 blocks); embeddings, LM head,
router, gates, norms and biases are copied unchanged, and ``config.json`` gains
``quantization_config: {quant_method: fp8, weight_block_size: [128, 128], activation_scheme: dynamic,
fmt: e4m3}``. Other files next to the checkpoint (tokenizer, generation config) are copied.

``write_fp8_config`` writes only such a ``config.json`` (from a preset or a model directory), for
dummy-weight benchmarks in which moeserve and vLLM both load the same block-FP8 model shape.

A dense MLP whose width is not a multiple of 128 (GLM-4.5-Air's first layer: 10944) stays in high precision
in both, listed in ``quantization_config.ignored_layers``: vLLM's block-FP8 linear quantises its input in
groups of 128 and refuses the down projection otherwise.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve.quant.fp8 import block_quant_fp8

QUANTIZATION_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                       "fmt": "e4m3"}
_QUANTIZABLE = re.compile(
    r"\.(self_attn\.(q|k|v|o)_proj"
    r"|mlp\.(gate|up|down)_proj"
    r"|mlp\.experts\.\d+\.(gate|up|down)_proj"
    r"|mlp\.shared_experts?\.(gate|up|down)_proj)\.weight$")


def high_precision_layers(hf: dict) -> list[str]:
    """The dense-MLP projections an FP8 checkpoint of this config keeps in high precision (``ignored_layers``)."""
    from moeserve.models import arch_from_hf
    arch = arch_from_hf(hf)
    if arch.dense_intermediate_size % 128 == 0:
        return []
    return [f"model.layers.{i}.mlp.{p}_proj" for i, moe in enumerate(arch.moe_layers) if not moe
            for p in ("gate", "up", "down")]


def _quantization_config(hf: dict) -> dict:
    qc = dict(QUANTIZATION_CONFIG)
    kept = high_precision_layers(hf)
    if kept:
        qc["ignored_layers"] = kept
    return qc


def is_quantizable_weight(name: str) -> bool:
    """Whether a checkpoint tensor is a linear weight that FP8 checkpoints store as e4m3 with block scales."""
    return _QUANTIZABLE.search(name) is not None


@torch.no_grad()
def write_fp8_checkpoint(src: str | Path, dst: str | Path) -> dict:
    """Quantise the safetensors checkpoint in ``src`` into ``dst`` (one file per source file, same names).

    Returns counts ``{"quantized": n, "copied": m}``.
    """
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = _quantization_config(cfg)
    kept = set(cfg["quantization_config"].get("ignored_layers", ()))
    counts = {"quantized": 0, "copied": 0}
    for path in sorted(src.glob("*.safetensors")):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if is_quantizable_weight(name) and t.dim() == 2 and name.removesuffix(".weight") not in kept:
                    q, s = block_quant_fp8(t)
                    out[name], out[name + "_scale_inv"] = q, s
                    counts["quantized"] += 1
                else:
                    out[name] = t.contiguous()
                    counts["copied"] += 1
        save_file(out, str(dst / path.name), metadata={"format": "pt"})
    for other in src.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name != "config.json":
            shutil.copy2(other, dst / other.name)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return counts


def write_fp8_config(model: str, out_dir: str | Path, **overrides) -> Path:
    """A directory holding ``model``'s ``config.json`` (a preset name or a model directory) with the block-FP8
    ``quantization_config`` added and ``overrides`` applied (e.g. ``num_hidden_layers=20``); returns it.

    Both engines read the format from that file: moeserve infers ``quantization: fp8`` and vLLM builds its
    block-FP8 (``weight_block_size [128, 128]``) layers, so with ``load_format: dummy`` they run the same model.
    """
    from moeserve.config import resolve_model_source
    cfg = dict(resolve_model_source(model).config)
    cfg.update(overrides)
    cfg["quantization_config"] = _quantization_config(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
