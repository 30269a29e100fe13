"""--help of every command: each flag has help and shows its default; the engine flags are derived from the
config's fields (choices from Literal types, --flag/--no-flag for bools); no reStructuredText markup."""
import argparse
import typing

import pytest

from moeserve.args import NOT_FLAGS, flag_of
from moeserve.backends import BACKEND_NAMES
from moeserve.cli import build_parser, main
from moeserve.config import EngineConfig

SKIPPED = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def all_parsers(parser, name="moeserve"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from all_parsers(sub, f"{name} {sub_name}")


def test_every_flag_of_every_command_has_help_and_shows_its_default():
    missing = []
    for name, parser in all_parsers(build_parser()):
        text = parser.format_help()
        if "`" in text:
            missing.append(f"{name}: reStructuredText backticks in --help")
        for action in parser._actions:
            if isinstance(action, SKIPPED):
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            help_text = parser._get_formatter()._get_help_string(action) or ""
            if not help_text.strip() or help_text == argparse.SUPPRESS:
                missing.append(f"{label}: no help")
            elif action.option_strings and not action.required and "default" not in help_text \
                    and "repeatable" not in help_text \
                    and not isinstance(action, argparse._StoreConstAction) and action.nargs != argparse.REMAINDER:
                missing.append(f"{label}: no default shown")
    assert not missing, "\n".join(missing)


def test_engine_flags_come_from_the_config_fields():
    serve = dict(all_parsers(build_parser()))["moeserve serve"]
    by_flag = {s: a for a in serve._actions for s in a.option_strings}
    for field, info in EngineConfig.model_fields.items():
        if field in NOT_FLAGS:
            continue
        action = by_flag[flag_of(field)]
        assert info.description and action.help.startswith(info.description)
        tp = info.annotation
        if typing.get_origin(tp) is typing.Literal:
            assert action.choices == list(typing.get_args(tp)), field
        if tp is bool:
            assert isinstance(action, argparse.BooleanOptionalAction) and "--no-" + flag_of(field)[2:] in by_flag
    for flag in ("--max-model-len", "--gpu-memory-utilization", "--max-num-seqs", "--max-num-batched-tokens",
                 "--dtype", "--quantization", "--load-format", "--seed", "--enforce-eager", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--served-model-name", "--api-key", "--host", "--port", "--model"):
        assert flag in by_flag, flag  # vLLM's names
    backend_help = by_flag["--backend"].help
    for op, names in BACKEND_NAMES.items():
        assert f"{op}=auto|{'|'.join(names)}" in backend_help


def test_serve_and_generate_take_the_model_as_positional_argument():
    parser = build_parser()
    args = parser.parse_args(["serve", "tiny", "--port", "9"])
    assert args.model_arg == "tiny" and args.port == 9
    args = parser.parse_args(["generate", "--prompt-token-ids", "1,2", "Qwen/Qwen1.5-MoE-A2.7B"])
    assert args.model_arg == "Qwen/Qwen1.5-MoE-A2.7B" and args.prompt_token_ids == [[1, 2]]
    args = parser.parse_args(["serve", "--model", "tiny", "--no-enable-prefix-caching", "--enforce-eager"])
    assert args.cfg_model == "tiny" and args.cfg_enable_prefix_caching is False and args.cfg_enforce_eager is True


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag, capsys):
    import moeserve
    assert main([flag]) == 0
    assert capsys.readouterr().out.strip() == f"moeserve {moeserve.__version__}"
