"""Command-line flags shared by every command that builds an engine: ``--config FILE`` (YAML) and one flag per
engine field, derived from ``EngineConfig`` (its descriptions are the help, its ``Literal`` types the
choices, its defaults the defaults shown; a bool field is ``--flag/--no-flag``), so the config and the
command line cannot drift apart. ``--set a.b=value`` overrides any field, ``--backend op=name`` picks an
operator backend. Also the parser class every moeserve command uses: help without reStructuredText markup,
and a mistake reported in one line."""
from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

from moeserve.backends import BACKEND_NAMES, OPERATORS
from moeserve.config import ConfigError, EngineConfig, load_config, parse_override

# Config sections (set through --set, --backend or the serve flags) and fields with a flag of their own.
NOT_FLAGS = ("backends", "bench", "server", "model", "distributed")
SHORT_FLAGS = {"tensor_parallel_size": ("-tp",)}  # vLLM's


# --- the parser ------------------------------------------------------------------------------------

def _plain(text: str) -> str:
    return text.replace("``", "").replace("`", "")


class HelpFormatter(argparse.HelpFormatter):
    """Paragraphs of a description kept apart, reStructuredText ````literals```` shown plain."""

    def _fill_text(self, text, width, indent):
        import textwrap
        paragraphs = [" ".join(p.split()) for p in _plain(text).split("\n\n") if p.strip()]
        return "\n\n".join(textwrap.fill(p, width, initial_indent=indent, subsequent_indent=indent)
                           for p in paragraphs)

    def _split_lines(self, text, width):
        return super()._split_lines(_plain(text), width)

    def _get_help_string(self, action):
        """The help, with ``(default: X)`` added where the flag has a default its help does not tell."""
        text = action.help or ""
        default = action.default
        if "default" in text or not action.option_strings or action.required or default is None \
                or default is False or default == [] or default is argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """moeserve's parser: its subcommands are of the same class, and a usage mistake is one line on stderr
    (``moeserve serve: error: argument --port: invalid int value: 'x' (see moeserve serve --help)``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def add_verbose(p: argparse.ArgumentParser, top: bool = False) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="debug logging, and the traceback of an error (default: off)")


# --- engine flags derived from EngineConfig ---------------------------------------------------------

def _unwrap_optional(tp):
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def field_flag_kwargs(name: str) -> dict[str, Any]:
    """``add_argument`` keyword arguments for the EngineConfig field ``name`` (``dest`` is ``cfg_<name>``, the
    default None: a flag not given leaves the YAML's value)."""
    info = EngineConfig.model_fields[name]
    tp = _unwrap_optional(info.annotation)
    help_text = info.description or name.replace("_", " ")
    if "default" not in help_text:
        help_text += f" (default: {_shown(info.default)})" if info.default is not None else " (default: none)"
    kw: dict[str, Any] = {"dest": f"cfg_{name}", "default": None, "help": help_text}
    if tp is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(tp) is Literal:
        kw["choices"] = list(typing.get_args(tp))
    elif typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        kw.update(type=item, nargs="*", metavar="N")
    elif tp in (int, float, str):
        kw.update(type=tp, metavar=name.upper())
    else:
        raise TypeError(f"EngineConfig.{name}: no command-line flag for type {tp!r}; list it in NOT_FLAGS")
    return kw


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def backend_help() -> str:
    rows = "; ".join(f"{op}={'|'.join(('auto',) + BACKEND_NAMES[op])}" for op in OPERATORS)
    return (f"the backend of one operator, e.g. --backend moe=triton (repeatable): {rows} (default: auto for "
            "every operator: the first one this machine runs; moeserve env shows which)")


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """The model as a positional argument (``moeserve serve MODEL``); ``--model`` is accepted as well."""
    p.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                   help=EngineConfig.model_fields["model"].description + " (required unless --model or the "
                   "config file names it)")
    p.set_defaults(model_required=True)


def add_config_args(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    if positional_model:
        add_model_arg(p)
    g = p.add_argument_group("engine configuration (flags override the YAML file)")
    g.add_argument("--config", "-c", metavar="FILE", help="YAML file of config fields; flags override it "
                   "(default: none)")
    model_help = EngineConfig.model_fields["model"].description
    g.add_argument("--model", dest="cfg_model", default=None, metavar="MODEL",
                   help=("the same as the positional MODEL (default: the positional MODEL)" if positional_model else model_help
                         + " (default: tiny)"))
    for name in EngineConfig.model_fields:
        if name not in NOT_FLAGS:
            g.add_argument(*SHORT_FLAGS.get(name, ()), flag_of(name), **field_flag_kwargs(name))
    g.add_argument("--master-addr", dest="cfg_distributed.master_addr", default=None, metavar="HOST",
                   help="address of rank 0 for a run across hosts (default: MASTER_ADDR, else this host)")
    g.add_argument("--master-port", dest="cfg_distributed.master_port", type=int, default=None, metavar="PORT",
                   help="port of rank 0's rendezvous (default: MASTER_PORT, else a free port)")
    g.add_argument("--backend", action="append", default=[], metavar="OP=NAME", help=backend_help())
    g.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any config field by its dotted name, e.g. --set bench.runs=5 (repeatable)")


# --- from the flags to a config ---------------------------------------------------------------------

def _model_override(args: argparse.Namespace) -> str | None:
    positional, flag = getattr(args, "model_arg", None), getattr(args, "cfg_model", None)
    if positional is not None and flag is not None and positional != flag:
        raise ConfigError(f"model: the positional MODEL ({positional!r}) and --model ({flag!r}) differ; give one")
    return positional if positional is not None else flag


def overrides_from_args(args: argparse.Namespace) -> dict:
    """``{dotted.field: value}`` from the engine flags, ``--backend op=name`` and ``--set field=value``."""
    overrides = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg_") and v is not None}
    model = _model_override(args)
    if model is not None:
        overrides["model"] = model
    for item in args.backend:
        key, value = parse_override(item)
        if key not in OPERATORS:
            raise ConfigError(f"config error: --backend {item!r}: {key!r} is not an operator; choose one of "
                              f"{', '.join(OPERATORS)}")
        overrides[f"backends.{key}"] = value
    for item in args.set:
        key, value = parse_override(item)
        overrides[key] = value
    return overrides


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config of a command's flags. A command whose model is positional (serve, generate) refuses to
    run without one rather than quietly taking the tiny preset."""
    cfg = load_config(args.config, overrides_from_args(args))
    if getattr(args, "model_required", False) and "model" not in cfg.model_fields_set:
        prog = getattr(args, "command", None) or "serve"
        raise ConfigError(f"no model given: moeserve {prog} MODEL (a preset such as tiny, a directory with "
                          "config.json and *.safetensors, or a Hugging Face id such as Qwen/Qwen1.5-MoE-A2.7B)")
    return cfg

