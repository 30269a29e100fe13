"""``moeserve env | generate | bench | compare | serve | precompile | install-kernels``.

Every command that builds an engine takes ``--config FILE`` (YAML) and flags that override its fields;
``--set a.b=value`` overrides any field, ``--backend op=name`` picks an operator backend.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from moeserve.args import add_config_args, config_from_args
from moeserve.config import ConfigError


def _cmd_env(args) -> int:
    from moeserve.tools.env_report import print_env
    return print_env(args)


def _cmd_generate(args) -> int:
    from moeserve import LLM, SamplingParams
    cfg = config_from_args(args)
    llm = LLM(config=cfg)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    prompts = list(args.prompt)
    for ids in args.prompt_token_ids:
        prompts.append({"prompt_token_ids": [int(t) for t in ids.split(",") if t.strip()]})
    if not prompts:
        print("generate: give --prompt TEXT or --prompt-token-ids 1,2,3", file=sys.stderr)
        return 2
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


def _subcommand_modules():
    """Subcommands that live with their feature: (name, module, help)."""
    return [
        ("bench", "moeserve.bench.cli", "benchmark moeserve (and vLLM) on the configured model"),
        ("compare", "moeserve.bench.cli_compare", "print two benchmark result files side by side"),
        ("serve", "moeserve.server.cli", "OpenAI-compatible HTTP server"),
        ("precompile", "moeserve.tools.precompile", "build the FlashInfer kernels this config will load, ahead of time"),
        ("install-kernels", "moeserve.tools.install", "install FlashInfer's pre-built kernel packages for this GPU"),
    ]


def build_parser() -> argparse.ArgumentParser:
    import importlib
    p = argparse.ArgumentParser(prog="moeserve", description=__doc__.split("\n")[0])
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("env", help="GPUs, versions and which kernels this machine can run")
    add_config_args(e)
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_cmd_env)

    g = sub.add_parser("generate", help="generate from prompts with the offline API")
    add_config_args(g)
    g.add_argument("--prompt", action="append", default=[], help="a text prompt (needs a tokenizer); repeatable")
    g.add_argument("--prompt-token-ids", action="append", default=[], metavar="1,2,3", help="a token-id prompt; repeatable")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=_cmd_generate)

    for name, module, help_text in _subcommand_modules():
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
    return p


def _torchrun_rank(args) -> int | None:
    """Under torchrun (``RANK`` set) every process runs the same command line: rank 0 runs the command, the
    other ranks build their part of the engine and run rank 0's steps (None: run the command here)."""
    from moeserve.ops.parallel import torchrun_env
    tr = torchrun_env()
    if tr is None or tr["rank"] == 0 or not hasattr(args, "set"):
        return None
    from moeserve.engine.workers import run_worker
    return run_worker(config_from_args(args))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = _torchrun_rank(args)
        if code is not None:
            return code
        return args.func(args) or 0
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, NotImplementedError) as e:
        from moeserve.backends import BackendUnavailable
        from moeserve.engine.requests import RequestError
        from moeserve.kernel_cache import KernelCacheError
        if isinstance(e, (BackendUnavailable, RequestError, KernelCacheError, NotImplementedError)) or type(e) is ValueError:
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
