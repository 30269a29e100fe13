"""Model weights: Hugging Face safetensors checkpoints (one file or sharded with an index, high precision or
block-FP8) or dummy random init.

The model lists every checkpoint tensor it expects (``checkpoint_entries``); loading copies each one into
its place and checks the shape. A missing tensor or a shape mismatch is an error that names the tensor.
A tensor stored in its parameter's dtype and read whole is a byte copy from the file to the device
(``moeserve.weight_reader``: parallel reads into pinned buffers, overlapped with the copies); the others go
through safetensors' reader.
On several ranks an entry names the part of the tensor this rank holds (``Entry.shard``): only that part is
read from the file (``safe_open(...).get_slice(name)[rows]``), with the matching block scales of an FP8
tensor; tensors of experts another rank holds are not read at all.
"""
from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from moeserve.models import checkpoint_name
from moeserve.models.parallel import Shard
from moeserve.progress import progress_bar
from moeserve.quant.fp8 import block_scale_shape
from moeserve.quant.loading import SCALE_SUFFIX, Fp8Placer, is_fp8, quantize_param_
from moeserve.weight_reader import ByteReader, ReadError, Span, read_header

if TYPE_CHECKING:  # the model's layers load torch.compile's machinery: not needed to check the files
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
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise WeightError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted({d / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise WeightError(f"{index.name} names shard(s) that are not in {d}: {', '.join(absent)}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors files in {d}")
    return files


def _open_shard(path: Path):
    """``safe_open`` of one shard; a truncated or corrupt file is a WeightError naming it (safetensors reads
    the header and checks that the data covers it)."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise WeightError(f"{path} is not a readable safetensors file ({e}); download it again") from None


def check_weight_files(weights_dir: str | Path) -> list[Path]:
    """The checkpoint's shards, each opened once to check its header: the problems a download can leave
    (a missing shard, a truncated or corrupt file) are found before the model is built."""
    files = checkpoint_files(weights_dir)
    for path in files:
        with _open_shard(path):
            pass
    return files


def check_weight_source(source, load_format: str) -> bool:
    """Whether ``source`` (a ``moeserve.config.ModelSource``) gets random weights under ``load_format``;
    raises WeightError when it should be read from files that are not there or cannot be read."""
    if load_format == "dummy" or (load_format == "auto" and source.config_dir is None and source.weights_dir is None):
        return True
    if source.weights_dir is None:
        where = source.config_dir or source.name
        raise WeightError(f"model {where!r} has no weight files (*.safetensors); point the model at a directory "
                          "with the checkpoint, or ask for random weights with --load-format dummy")
    check_weight_files(source.weights_dir)
    return False


@torch.no_grad()
def load_checkpoint(model: MoECausalLM, weights_dir: str | Path, progress: bool | None = None) -> dict:
    """Copy a safetensors checkpoint into ``model``; returns counts of what was loaded and skipped.

    FP8 checkpoint tensors (``float8_e4m3fn`` with a ``<name>_scale_inv`` block-scale tensor beside them) go
    into FP8 parameters as they are, or are dequantised into high-precision ones; high-precision tensors are
    quantised on arrival into FP8 parameters (see ``moeserve.quant.loading``). A progress bar counts the
    shards (``progress``: default when stderr is a terminal).
    """
    entries = model.checkpoint_entries()
    model_type = model.arch.model_type
    loaded: set[str] = set()
    unexpected: list[str] = []
    placer = Fp8Placer()
    files = checkpoint_files(weights_dir)
    device = next(model.parameters()).device
    with ExitStack() as stack:
        where, shards = {}, []
        for path in files:
            f = stack.enter_context(_open_shard(path))
            shards.append((path, f))
            for name in f.keys():
                where[name] = f
        reader = ByteReader(device)
        stack.callback(reader.finish)
        advance = stack.enter_context(progress_bar("Loading safetensors shards", len(shards), enabled=progress))
        for path, f in shards:
            try:
                spans = read_header(path)
            except ReadError as e:
                raise WeightError(f"{e}; download it again") from None
            for name in f.keys():
                if where[name] is not f or (name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in where):
                    continue  # a duplicate read from its last shard; a scale read together with its weight
                key = checkpoint_name(model_type, name)
                entry = entries.get(key)
                if entry is None:
                    if not key.endswith(IGNORED_SUFFIXES) and not (key == "lm_head.weight" and model.arch.tie_word_embeddings):
                        unexpected.append(name)
                    continue
                if entry.param is None:
                    continue  # another rank's (an expert it holds)
                target = entry.param.data[entry.index] if entry.index else entry.param.data
                try:
                    full = tuple(f.get_slice(name).get_shape())
                    shape = _part_shape(name, full, entry.shard)
                    if shape != tuple(target.shape):
                        part = " (this rank's part)" if entry.shard is not None else ""
                        raise WeightError(f"checkpoint tensor {name!r} has shape {list(shape)}{part} but the model "
                                          f"({model_type}) expects {list(target.shape)}")
                    span = spans.get(name)
                    if _plain_copy(entry, target, span):
                        reader.add(name, span.begin, span.end, target)  # read below with the rest of this file
                    else:
                        _load_tensor(placer, entry, target, name, read_part(f, name, entry.shard), where, full)
                except SafetensorError as e:
                    raise WeightError(f"{path}: cannot read tensor {name!r} ({e}); download it again") from None
                loaded.add(key)
                loaded.update(entry.covers)
            try:
                reader.read_file(path)
            except ReadError as e:
                raise WeightError(f"{e}; download it again") from None
            advance()
    required = {name for name, e in entries.items() if not e.covers and e.param is not None}
    missing = sorted(required - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise WeightError(f"checkpoint in {weights_dir} lacks {len(missing)} tensor(s) the model needs: {shown}")
    if unexpected:
        log.warning("ignored %d checkpoint tensor(s) the model does not use, e.g. %s", len(unexpected), unexpected[:3])
    return {"loaded": len(loaded), "ignored": len(unexpected)}


def _plain_copy(entry, target: torch.Tensor, span: Span | None) -> bool:
    """Whether a checkpoint tensor is a byte copy into ``target``: read whole, stored in the parameter's dtype,
    neither side FP8 (whose block scales travel with it)."""
    return (span is not None and entry.shard is None and span.dtype == target.dtype and not is_fp8(target)
            and target.is_contiguous() and span.end - span.begin == target.numel() * target.element_size())


def _part_shape(name: str, full: tuple[int, ...], shard: Shard | None) -> tuple[int, ...]:
    if shard is None:
        return full
    try:
        return shard.shape(full)
    except ValueError as e:
        raise WeightError(f"checkpoint tensor {name!r} of shape {list(full)} cannot be split: {e}") from None


def read_part(f, name: str, shard: Shard | None, ranges: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """Tensor ``name`` of the open safetensors file ``f``, or only the part ``shard`` describes (the ranges
    along its dimension read as slices, then joined)."""
    if shard is None:
        return f.get_tensor(name)
    sl = f.get_slice(name)
    full = tuple(sl.get_shape())
    d = shard.dim % len(full)
    ranges = shard.ranges(full[d]) if ranges is None else ranges
    lead = (slice(None),) * d
    pieces = [sl[(*lead, slice(a, b))] for a, b in ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=d)


def _read_scale(f, scale_name: str, name: str, shard: Shard | None, weight_shape: tuple[int, ...]) -> torch.Tensor:
    """The block scales of this rank's part of an FP8 weight (whole blocks only)."""
    if shard is None:
        return f.get_tensor(scale_name)
    try:
        return read_part(f, scale_name, shard, shard.scale_ranges(weight_shape, name))
    except ValueError as e:
        raise WeightError(str(e)) from None


def _load_tensor(placer: Fp8Placer, entry, target: torch.Tensor, name: str, tensor: torch.Tensor, where: dict,
                 full_shape: tuple[int, ...]) -> None:
    """One checkpoint tensor (this rank's part of it) into ``entry``: plain copy, FP8 copy with scales,
    dequantise or quantise."""
    param_fp8 = is_fp8(entry.param)
    if is_fp8(tensor):
        scale_name = name + SCALE_SUFFIX
        if scale_name not in where:
            raise WeightError(f"checkpoint tensor {name!r} is float8_e4m3fn but its block scales "
                              f"{scale_name!r} are not in the checkpoint")
        scale = _read_scale(where[scale_name], scale_name, name, entry.shard, full_shape)
        try:
            if param_fp8:
                placer.place_fp8(name, entry.param, entry.scale, entry.index, tensor, scale, scale_name)
            else:
                if tuple(scale.shape[-2:]) != block_scale_shape(*tensor.shape[-2:]):
                    raise ValueError(f"checkpoint tensor {scale_name!r} has shape {list(scale.shape)} but {name!r} "
                                     f"of shape {list(tensor.shape)} needs 128x128 block scales of shape "
                                     f"{list(block_scale_shape(*tensor.shape[-2:]))}")
                placer.dequantize_into(target, tensor, scale)
        except ValueError as e:
            raise WeightError(str(e)) from None
    elif param_fp8:
        placer.quantize_into(entry.param, entry.scale, entry.index, tensor)
    else:
        target.copy_(tensor.to(target.dtype))


def load_weights(model: MoECausalLM, source, load_format: str, seed: int = 0) -> str:
    """Put weights into ``model`` from ``source`` (a ``moeserve.config.ModelSource``); returns the format used.

    ``auto`` reads the checkpoint when the model has weight files and draws random weights for a preset
    (which has none by design); a model directory without weight files is refused, not filled with random
    weights, unless ``load_format: dummy`` asks for them (``check_weight_source``).
    """
    if check_weight_source(source, load_format):
        init_dummy(model, seed=seed)
        return "dummy"
    load_checkpoint(model, source.weights_dir)
    return "safetensors"


@torch.no_grad()
def init_dummy(model: MoECausalLM, seed: int = 0, std: float | None = None) -> None:
    """Random weights of the right shapes: N(0, initializer_range) matrices, unit norms, zero biases.

    An FP8 parameter gets the same draw a high-precision model would (in the model dtype), quantised, so an
    FP8 dummy model is the quantised version of the high-precision one with the same seed.
    """
    std = model.arch.initializer_range if std is None else std
    gens: dict[torch.device, torch.Generator] = {}
    params = dict(model.named_parameters())
    dtype = model.embed_tokens.dtype
    for name, p in params.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in params:
            continue  # set when its weight is quantised
        if leaf in NORM_NAMES:  # norm weights are parameters named after the norm
            p.fill_(1.0)
        elif leaf in ("bias", "correction_bias"):
            p.zero_()
        else:
            g = gens.get(p.device)
            if g is None:
                g = gens[p.device] = torch.Generator(device=p.device)
                g.manual_seed(seed)
            if is_fp8(p):
                draw = torch.empty(p.shape, dtype=dtype, device=p.device).normal_(0.0, std, generator=g)
                quantize_param_(p, params[name + SCALE_SUFFIX], draw)
                del draw
            else:
                p.normal_(0.0, std, generator=g)
