"""vLLM's dummy weights drawn by moeserve's rule, so that both engines of a benchmark run the same kind of
random model.

vLLM's dummy loader fills every floating-point tensor with U(-1e-3, 1e-3) from a generator seeded alike
for every tensor (``initialize_dummy_weights`` in ``vllm/model_executor/model_loader/weight_utils.py``):
tensors of one shape hold the same values, and norm weights are near zero. moeserve's dummy model
(``moeserve.weights.init_dummy``) draws N(0, initializer_range) matrices with unit norms. A random MoE
model decides which experts each token uses and how diverse greedy decoding stays, and so how many expert
weights a decode step reads; two engines are only compared like for like on the same kind of model.

With ``bench.vllm.dummy_init: moeserve`` (the default) the vLLM worker registers :func:`register` as a vLLM
general plugin (an entry point in a ``.dist-info`` on the worker's ``PYTHONPATH``); vLLM loads it in every
one of its processes, and it replaces the dummy initializer with :func:`init_like_moeserve`.

Not covered: layers vLLM quantises online (``quantization: fp8`` on a high-precision checkpoint) are drawn by
``initialize_single_dummy_weight``, which keeps vLLM's rule. Block-FP8 checkpoints (a ``config.json`` with
``quantization_config``, as ``moeserve.tools.fp8_export.write_fp8_config`` writes) are covered.
"""
from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: moeserve's argument parser reads this module's add_args
    import torch

log = logging.getLogger(__name__)

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "moeserve_dummy_init"
DIST_NAME = "moeserve_vllm_dummy_init"
_DONE = "_moeserve_dummy_init_done"
_SCALE_SUFFIXES = ("_scale_inv", "_scale")


def is_norm_module(module: torch.nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "norm" in name and "gemma" not in name  # Gemma's norms store weight - 1


def _scale_of(module: torch.nn.Module, name: str) -> torch.nn.Parameter | None:
    import torch
    for suffix in _SCALE_SUFFIXES:
        p = getattr(module, name + suffix, None)
        if isinstance(p, torch.Tensor):
            return p
    return None


def _is_scale(module: torch.nn.Module, name: str) -> bool:
    import torch
    for suffix in _SCALE_SUFFIXES:
        if name.endswith(suffix) and isinstance(getattr(module, name[:-len(suffix)], None), torch.Tensor):
            return True
    return False


def _fill_fp8(p: torch.Tensor, scale: torch.Tensor | None, std: float, gen: torch.Generator) -> bool:
    """Draw ``p`` in bf16, quantise it with 128x128 block scales into ``p`` and ``scale``; False when the
    scale's shape is not the block layout (the caller then leaves the tensor to vLLM's own rule); runs
    under the caller's no_grad."""
    import torch

    from moeserve.quant.fp8 import block_scale_shape, block_quant_fp8
    if scale is None or p.dim() < 2 or not (p.is_contiguous() and scale.is_contiguous()):
        return False
    if tuple(scale.shape) != (*p.shape[:-2], *block_scale_shape(*p.shape[-2:])):
        return False
    # one matrix at a time (one expert of a fused MoE weight): the float32 work stays small beside the weights
    flat_p, flat_s = p.view(-1, *p.shape[-2:]), scale.view(-1, *scale.shape[-2:])
    for i in range(flat_p.shape[0]):
        draw = torch.empty(flat_p.shape[1:], dtype=torch.bfloat16, device=p.device).normal_(0.0, std, generator=gen)
        q, s = block_quant_fp8(draw)
        flat_p[i].copy_(q.to(p.dtype))
        flat_s[i].copy_(s.to(scale.dtype))
    return True


def init_like_moeserve(model: torch.nn.Module, model_config=None, *args, seed: int = 0, **kwargs) -> None:
    """moeserve's dummy rule on a vLLM module tree: norm weights 1, biases 0 (``e_score_correction_bias``
    too), FP8 weights drawn in bf16 and block-quantised with their ``*_scale_inv``, everything else
    N(0, ``initializer_range``). vLLM calls the initializer on every module of the model in turn; a
    parameter is drawn once. Returns the replaced initializer's signature's ``None``."""
    import torch
    with torch.no_grad():
        _init_like_moeserve(model, model_config, seed)


def _init_like_moeserve(model: torch.nn.Module, model_config, seed: int) -> None:
    import torch
    hf = getattr(model_config, "hf_config", None)
    std = float(getattr(hf, "initializer_range", None) or 0.02)
    gens: dict[torch.device, torch.Generator] = {}
    skipped, drawn = [], 0
    for mod_name, mod in model.named_modules():
        norm = is_norm_module(mod)
        for name, p in mod.named_parameters(recurse=False):
            if getattr(p, _DONE, False) or not torch.is_floating_point(p) or p.device.type == "meta":
                continue
            if _is_scale(mod, name):
                continue  # written with its weight
            g = gens.get(p.device)
            if g is None:
                g = gens[p.device] = torch.Generator(device=p.device)
                g.manual_seed(seed)
            if norm and name == "weight":
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif p.element_size() == 1:
                scale = _scale_of(mod, name)
                if not _fill_fp8(p, scale, std, g):
                    skipped.append(f"{mod_name}.{name}")
                    continue
                setattr(scale, _DONE, True)
            else:
                p.normal_(0.0, std, generator=g)
            setattr(p, _DONE, True)
            drawn += 1
    # vLLM's processes do not show this package's log records; stderr lands in the worker's log
    print(f"[moeserve dummy init] {drawn} tensors drawn by moeserve's rule (std {std})", file=sys.stderr, flush=True)
    if skipped:
        log.warning("moeserve dummy init: %d FP8 tensors without a 128x128 block scale keep vLLM's values: %s",
                    len(skipped), ", ".join(skipped[:5]))


def register() -> None:
    """vLLM general-plugin entry point: replace the dummy initializer in this process."""
    from vllm.model_executor.model_loader import dummy_loader, weight_utils
    dummy_loader.initialize_dummy_weights = init_like_moeserve
    weight_utils.initialize_dummy_weights = init_like_moeserve


def add_args(p) -> None:
    """``moeserve bench vllm-plugin --out DIR``: the plugin for a vLLM you start yourself (``vllm serve``)."""
    p.add_argument("--out", required=True, metavar="DIR",
                   help="directory to put on vLLM's PYTHONPATH (it gets the plugin's entry point)")


def run(args) -> int:
    """Write the plugin's entry point into ``--out`` and print the ``PYTHONPATH`` that makes every vLLM process
    draw its dummy weights by moeserve's rule (for ``vllm serve --load-format dummy`` in ``bench online``)."""
    import os
    from pathlib import Path

    import moeserve
    out = Path(args.out).expanduser().resolve()
    write_plugin_dist(out)
    root = Path(moeserve.__file__).resolve().parent.parent
    print(f"wrote the vLLM plugin entry point '{PLUGIN_NAME}' under {out}")
    print(f"export PYTHONPATH={out}{os.pathsep}{root}${{PYTHONPATH:+{os.pathsep}$PYTHONPATH}}")
    return 0


def write_plugin_dist(site) -> None:
    """Make ``site`` (a directory on the worker's ``PYTHONPATH``) declare the plugin entry point."""
    from pathlib import Path
    dist = Path(site) / f"{DIST_NAME}-0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = moeserve.bench.vllm_dummy:register\n")
