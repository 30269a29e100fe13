"""What the commands check before a model loads: the config, the plan (model, device, dtype, backends,
``max_model_len``), the weight files, the sampling parameters and request limits, the address to listen on.
A mistake found here costs the user a second, not a model load."""
from __future__ import annotations

import argparse

from moeserve.config import EngineConfig


def check_engine(cfg: EngineConfig):
    """The plan of ``cfg`` and a check that its weights can be read; returns the plan."""
    from moeserve.plan import resolve_plan
    from moeserve.weights import check_weight_source
    plan = resolve_plan(cfg)
    check_weight_source(plan.source, cfg.load_format)
    return plan


def check_listen_address(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go: an address in use or one this machine cannot bind is an
    OSError naming it, raised before the model loads (port 0 checks the host alone)."""
    from moeserve.server.cli import bind_socket
    if not 0 <= port <= 65535:  # refused with the server settings
        return
    try:
        bind_socket(host, port).close()
    except OSError as e:
        shown = f"[{host}]" if ":" in host else host
        raise OSError(e.errno, f"cannot listen on {shown}:{port}: {e.strerror or e}") from None


def check_serve(args: argparse.Namespace) -> None:
    """``moeserve serve``: config, server settings, address, plan and weights, before ``run_serve`` loads the
    model (the cheap checks first: a mistake there is answered without importing torch)."""
    from moeserve.server.cli import serve_config_from_args
    cfg = serve_config_from_args(args)
    check_listen_address(cfg.server.host, cfg.server.port)
    check_engine(cfg)


def sampling_params_from_args(args: argparse.Namespace, flags: dict[str, str]):
    """``SamplingParams`` of the generate flags; a bad value is refused naming its flag (``--top-p``)."""
    from moeserve.engine.requests import RequestError
    from moeserve.engine.sampling_params import SamplingParams
    values = {field: getattr(args, dest) for field, dest in flags.items()}
    try:
        return SamplingParams(**values)
    except ValueError as e:
        field, _, why = str(e).partition(": ")
        dest = flags.get(field)
        flag = "--" + (dest or field).replace("_", "-")
        raise RequestError(f"{flag}: {why}" if why else str(e)) from None


def check_prompts(plan, texts: list[str], token_prompts: list[list[int]], params) -> None:
    """Each prompt against the model's vocabulary and context (``--prompt-token-ids`` N names the Nth)."""
    from moeserve.engine.requests import RequestError, RequestLimits, validate_request
    from moeserve.config import has_tokenizer_files
    tokenizer = has_tokenizer_files(plan.source.config_dir)
    if texts and not tokenizer:
        raise RequestError("--prompt: this model has no tokenizer; give token ids with --prompt-token-ids 1,2,3")
    limits = RequestLimits(plan.arch.vocab_size, plan.max_model_len, tokenizer)
    for i, ids in enumerate(token_prompts):
        validate_request(ids, params, limits, where=f"--prompt-token-ids #{i + 1}")
