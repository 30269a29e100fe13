"""One random checkpoint on disk that every engine of a benchmark loads through its real loader.

Two engines' own dummy initialisations draw different weights (vLLM's ``U(-1e-3, 1e-3)`` sends a batch to a
few experts), so their figures are not a comparison. ``write_random_checkpoint`` draws moeserve's dummy
weights (N(0, initializer_range) matrices, unit norms, zero biases) for the model's shape on the fastest
device, writes them as sharded safetensors under Hugging Face names with the model's ``config.json``, and
marks the directory so a later run with the same model, dtype and seed reuses it.

    python -m moeserve.bench.checkpoint qwen1.5-moe-a2.7b --out DIR [--dtype bfloat16] [--seed 0]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

MARKER = "moeserve-random-checkpoint.json"
SHARD_BYTES = 4 << 30


def _config_digest(hf_config: dict) -> str:
    return hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()[:16]


def marker_for(name: str, hf_config: dict, dtype: str, seed: int) -> dict:
    import moeserve
    return {"model": name, "config_sha256": _config_digest(hf_config), "dtype": dtype, "seed": seed,
            "rule": "moeserve dummy init: N(0, initializer_range) matrices, unit norms, zero biases",
            "moeserve_version": moeserve.__version__}


def reusable(out: Path, marker: dict) -> bool:
    """True when ``out`` already holds the checkpoint ``marker`` describes, complete."""
    try:
        have = json.loads((out / MARKER).read_text())
        index = json.loads((out / "model.safetensors.index.json").read_text())
    except (OSError, ValueError):
        return False
    keys = ("model", "config_sha256", "dtype", "seed", "rule")
    return (all(have.get(k) == marker[k] for k in keys)
            and all((out / f).is_file() for f in set(index.get("weight_map", {}).values())))


def _build(arch, dtype: torch.dtype, device: torch.device):
    """The model's parameters (torch reference backends: nothing but the shapes matters here)."""
    from moeserve.models.layers import MoECausalLM, Ops
    from moeserve.ops.basic import TorchActivation, TorchNorm, TorchRope
    from moeserve.ops.linear import TorchLinear
    from moeserve.ops.moe.torch_ref import TorchMoE
    ops = Ops(linear=TorchLinear(device, dtype), norm=TorchNorm(), activation=TorchActivation(),
              moe=TorchMoE(device, dtype), rope_cls=TorchRope)
    return MoECausalLM(arch, ops, dtype, device)


@torch.no_grad()
def hf_tensors(model) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of ``model`` under its Hugging Face name (per-expert layout)."""
    from moeserve.models import hf_name
    out = {}
    for name, entry in model.checkpoint_entries().items():
        if entry.covers:  # a stacked alias of per-expert tensors already listed
            continue
        t = entry.param.data[entry.index] if entry.index else entry.param.data
        out[hf_name(model.arch.model_type, name)] = t
    return out


def write_random_checkpoint(model: str, out: str | Path, dtype: str = "bfloat16", seed: int = 0,
                            device: str | None = None, log=print) -> Path:
    """Write (or reuse) the random checkpoint of ``model`` (a preset or a directory/file with config.json)."""
    from moeserve.config import resolve_model_source
    from moeserve.models import arch_from_hf
    from moeserve.weights import init_dummy
    from safetensors.torch import save_file

    source = resolve_model_source(model)
    out = Path(out)
    marker = marker_for(source.name, source.config, dtype, seed)
    if reusable(out, marker):
        log(f"checkpoint: reusing the random {source.name} checkpoint in {out}")
        return out
    t0 = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    arch = arch_from_hf(source.config)
    torch_dtype = getattr(torch, dtype)
    built = _build(arch, torch_dtype, dev)
    init_dummy(built, seed=seed)
    tensors = hf_tensors(built)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    weight_map, shard, size, total, files = {}, {}, 0, 0, []

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if size and size + n > SHARD_BYTES:
            flush()
        shard[name] = t.to("cpu", copy=True).contiguous()
        size += n
        total += n
    flush()
    del built, tensors
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = dict(source.config, torch_dtype=dtype)
    config.pop("dtype", None)
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / MARKER).write_text(json.dumps(marker, indent=1))
    log(f"checkpoint: wrote a random {source.name} checkpoint ({total / 2**30:.1f} GiB in {len(files)} files, "
        f"{dtype}, seed {seed}) to {out} in {time.perf_counter() - t0:.1f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moeserve.bench.checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a preset name or a directory with config.json")
    p.add_argument("--out", required=True, help="directory to write (reused when it already holds it)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="where to draw the weights (default: cuda when present)")
    args = p.parse_args(argv)
    write_random_checkpoint(args.model, args.out, args.dtype, args.seed, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
