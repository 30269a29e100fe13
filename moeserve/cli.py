"""moeserve serve MODEL | generate MODEL | bench | compare | env | precompile | install-kernels

Every command that builds an engine takes --config FILE (YAML) and flags that override its fields;
--set a.b=value overrides any field, --backend op=name picks an operator backend. A mistake (a bad flag,
an unknown model, a port in use, a corrupt checkpoint) is reported in one line before the model loads
where it can be; -v adds the traceback.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback

# moeserve.args (and torch with it) is imported inside main(), where Ctrl+C during the import exits quietly

# generate's sampling flags: SamplingParams field -> argparse dest
SAMPLING_FLAGS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                  "min_p": "min_p", "seed": "sampling_seed", "ignore_eos": "ignore_eos"}


def _cmd_env(args) -> int:
    from moeserve.tools.env_report import print_env
    return print_env(args)


def token_ids(text: str) -> list[int]:
    """``--prompt-token-ids 1,2,3``: a bad list is a usage error naming the value."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r} holds no token id; write them like 1,2,3")
    for p in parts:
        if not p.isdigit():
            raise argparse.ArgumentTypeError(f"{text!r} is not a list of token ids: {p!r} is not a "
                                             "non-negative integer")
    return [int(p) for p in parts]


def _cmd_generate(args) -> int:
    from moeserve.args import config_from_args
    from moeserve.preflight import check_engine, check_prompts, sampling_params_from_args
    cfg = config_from_args(args)
    params = sampling_params_from_args(args, SAMPLING_FLAGS)
    if not args.prompt and not args.prompt_token_ids:
        print("error: generate: give --prompt TEXT or --prompt-token-ids 1,2,3", file=sys.stderr)
        return 2
    plan = check_engine(cfg)
    check_prompts(plan, args.prompt, args.prompt_token_ids, params)

    from moeserve import LLM
    llm = LLM(config=cfg)
    prompts = list(args.prompt) + [{"prompt_token_ids": ids} for ids in args.prompt_token_ids]
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    rows = [{"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids, "token_ids": o.outputs[0].token_ids,
             "text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason} for o in outs]
    if args.json:
        print(json.dumps({"backends": llm.engine.runner.backend_names, "outputs": rows}, indent=2))
    else:
        for r in rows:
            shown = r["text"] if r["text"] else r["token_ids"]
            print(f"{r['prompt'] if r['prompt'] is not None else r['prompt_token_ids']!r} -> {shown!r} "
                  f"({r['finish_reason']})")
    return 0


def _add_generate(sub) -> None:
    from moeserve.args import add_config_args
    g = sub.add_parser("generate", help="generate from prompts with the offline API",
                       description="Generate from prompts with the offline API (LLM.generate) and print the "
                       "outputs: moeserve generate tiny --prompt-token-ids 1,2,3")
    add_config_args(g, positional_model=True)
    s = g.add_argument_group("prompts and sampling")
    s.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a text prompt (needs a model with a tokenizer); repeatable")
    s.add_argument("--prompt-token-ids", action="append", default=[], type=token_ids, metavar="1,2,3",
                   help="a prompt of token ids, comma-separated; repeatable")
    s.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per prompt (default: 16)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0.0)")
    s.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 or -1: all "
                   "(default: 0)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1] (default: 1.0)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p times the likeliest's "
                   "probability, in [0, 1] (default: 0.0)")
    s.add_argument("--sampling-seed", type=int, default=None, help="the seed of each request's sampling "
                   "(default: none: from the engine's seed)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens "
                   "(default: off)")
    s.add_argument("--json", action="store_true", help="print the outputs and backends as JSON (default: off)")
    g.set_defaults(func=_cmd_generate)


def _subcommand_modules():
    """Subcommands that live with their feature: (name, module, help)."""
    return [
        ("serve", "moeserve.server.cli", "OpenAI-compatible HTTP server: moeserve serve MODEL"),
        ("bench", "moeserve.bench.cli", "benchmark moeserve (and vLLM) on the configured model"),
        ("compare", "moeserve.bench.cli_compare", "print two benchmark result files side by side"),
        ("precompile", "moeserve.tools.precompile", "build the FlashInfer kernels this config will load, ahead of time"),
        ("install-kernels", "moeserve.tools.install", "install FlashInfer's pre-built kernel packages for this GPU"),
    ]


def _version() -> str:
    import moeserve
    return f"moeserve {moeserve.__version__}"


def _add_verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """``-v`` after any subcommand too (``moeserve serve tiny -v``)."""
    from moeserve.args import add_verbose
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                if not any("--verbose" in a.option_strings for a in sp._actions):
                    add_verbose(sp)
                _add_verbose_everywhere(sp)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    from moeserve.args import ArgumentParser, add_config_args, add_verbose
    from moeserve.preflight import check_serve
    p = ArgumentParser(prog="moeserve", description=__doc__.split("\n", 1)[1])
    p.add_argument("-V", "--version", action="version", version=_version(), help="print the version and exit")
    add_verbose(p, top=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for name, module, help_text in _subcommand_modules()[:1]:
        importlib.import_module(module).register(sub, name, help_text)
    sub.choices["serve"].set_defaults(preflight=check_serve)
    _add_generate(sub)
    e = sub.add_parser("env", help="GPUs, versions and which kernels this machine can run")
    add_config_args(e)
    e.add_argument("--json", action="store_true", help="print the report as JSON (default: off)")
    e.set_defaults(func=_cmd_env)

    for name, module, help_text in _subcommand_modules()[1:]:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name and err.name.startswith("moeserve"):
                continue  # feature not part of this build
            raise
        if hasattr(mod, "register"):
            mod.register(sub, name, help_text)
        else:  # a tool module: add_args(parser) and run(args)
            sp = sub.add_parser(name, help=help_text, description=(mod.__doc__ or "").split("\n\n")[0])
            mod.add_args(sp)
            sp.set_defaults(func=mod.run)
    _add_verbose_everywhere(p)
    return p


def _torchrun_rank(args) -> int | None:
    """Under torchrun (``RANK`` set) every process runs the same command line: rank 0 runs the command, the
    other ranks build their part of the engine and run rank 0's steps (None: run the command here)."""
    from moeserve.ops.parallel import torchrun_env
    tr = torchrun_env()
    if tr is None or tr["rank"] == 0 or not hasattr(args, "set"):
        return None
    from moeserve.args import config_from_args
    from moeserve.engine.workers import run_worker
    return run_worker(config_from_args(args))


# --- errors -----------------------------------------------------------------------------------------

# Exceptions that report a user's mistake or the machine's state, not a bug: (module, class). One that was
# raised was imported; looking them up in sys.modules keeps a quick failure from importing torch.
USER_ERRORS = [("moeserve.config", "ConfigError"), ("moeserve.hub", "HubError"), ("moeserve.weights", "WeightError"),
               ("moeserve.backends", "BackendUnavailable"), ("moeserve.hardware", "DeviceError"),
               ("moeserve.engine.requests", "RequestError"), ("moeserve.kernel_cache.layout", "KernelCacheError"),
               ("moeserve.deps", "MissingDependency"), ("moeserve.bench.serving_overhead", "ServerStartError")]


def user_error_types() -> tuple[type[BaseException], ...]:
    """The user-error classes imported so far, with NotImplementedError and OSError: one line, no traceback."""
    found = [getattr(sys.modules[m], name) for m, name in USER_ERRORS if m in sys.modules]
    return (*found, NotImplementedError, OSError)


def error_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror + (f": {e.filename}" if e.filename else "")
    else:
        text = str(e).strip() or type(e).__name__
    text = " ".join(text.split())  # one line
    return text if text.startswith(("error:", "config error:")) else f"error: {text}"


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv) in (["-V"], ["--version"]):
        print(_version())  # without importing the engine's dependencies
        return 0
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        return 130
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = _torchrun_rank(args)
        if code is not None:
            return code
        if getattr(args, "preflight", None) is not None:
            args.preflight(args)
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if not (isinstance(e, user_error_types()) or type(e) is ValueError):
            raise  # a bug: the traceback is the report
        if args.verbose:
            traceback.print_exc()
        print(error_line(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
