"""Offline decode throughput of whichever moeserve is importable, on one checkpoint: for comparing two commits
or two options of moeserve with the same script, weights and shapes.

For each concurrency c, each run (after one warm-up run) is the benchmark's own decode cell
(``moeserve.bench.workloads``): c random prompts of ``--prompt-len`` tokens, greedy, ``ignore_eos``,
``--output-len`` tokens, driven step by step; with ``t_1`` the time every request has its first token and
``t_N`` its last, decode tok/s = c * (N - 1) / (t_N - t_1), the median of ``--runs``. The JSON line also lists
every run's rate and TTFT, to tell a slow process from a slow run. (Until 2026-12-01 the script timed a pass of
N tokens and a separate pass of one token and divided by the difference; the one-token pass took 17 to 44 ms at
c=1 depending on the process, and wherever that differed from the prefill inside the long pass the rate was off.)

    python scripts/decode_ab.py --model CKPT_DIR --concurrency 1 8 32 [--set kernel_cache_dir=DIR]

A ``--set py.MODULE.NAME=VALUE`` sets a module constant of moeserve before the engine is built (an experiment's
switch or bound, e.g. ``py.moeserve.ops.linear_triton.GEMV_MAX_N=1000000``; the value read as YAML), instead of a
copy of the source tree with the constant changed. Only constants the code reads when it runs take effect (not
default arguments bound at import). The kernel cache does not know of them: a constant that changes a Triton
kernel needs ``allow_jit=true``, or the engine refuses the kernel it lacks. The JSON line lists the constants as
the process read them back (typed where JSON holds the value, else its ``repr``).
"""
from __future__ import annotations

import argparse
import importlib
import json


def module_constants(sets: list[str]):
    """The ``py.MODULE.NAME=VALUE`` entries of ``sets``: ``(entry, MODULE, NAME, VALUE read as YAML)`` each."""
    from moeserve.config import parse_override
    for kv in sets:
        if kv.startswith("py."):
            key, value = parse_override(kv[3:])
            module, _, name = key.rpartition(".")
            yield kv, module, name, value


def plain(value):
    """``value`` as JSON holds it (a number, a string, a bool, lists and maps of them), else its ``repr``."""
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return repr(value)


def set_module_constants(sets: list[str]) -> None:
    """Apply the ``py.MODULE.NAME=VALUE`` entries of ``sets`` (:func:`module_constants`; ``main`` reads them back
    after the run). A module outside moeserve, one that does not import, or a name it does not have is a
    ``ValueError`` naming it."""
    for kv, module, name, value in module_constants(sets):
        if not module.startswith("moeserve."):
            raise ValueError(f"--set {kv}: only moeserve's modules take constants, not {module!r}")
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"--set {kv}: module {module!r} does not import ({e})") from None
        if not hasattr(mod, name):
            raise ValueError(f"--set {kv}: {module!r} has no constant {name!r}")
        setattr(mod, name, value)


def build_llm(model: str, sets: list[str]):
    """The engine every A/B instrument here runs: ``model`` with the benchmark's limits, then ``--set`` overrides
    (``py.MODULE.NAME=VALUE`` ones set module constants first: :func:`set_module_constants`)."""
    from moeserve import LLM
    from moeserve.config import load_config, parse_override
    opts = dict(model=model, dtype="bfloat16", max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=8192,
                gpu_memory_utilization=0.85)
    set_module_constants(sets)
    return LLM(config=load_config(None, opts | dict(parse_override(kv) for kv in sets if not kv.startswith("py."))))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--set", action="append", default=[],
                   help="engine option key=value or section.key=value (the value read as YAML, as the CLI's --set), "
                   "or py.MODULE.NAME=VALUE: a moeserve module constant")
    p.add_argument("--label", default="")
    args = p.parse_args()
    from moeserve.bench.engine_driver import MoeserveAdapter
    from moeserve.bench.workloads import WorkloadCase, run_case
    try:
        llm = build_llm(args.model, args.set)
    except ValueError as e:
        raise SystemExit(f"decode_ab: {e}") from None
    adapter = MoeserveAdapter(llm.engine)
    vocab = llm.engine.arch.vocab_size
    rows = []
    for c in args.concurrency:
        case = WorkloadCase("decode", c, args.prompt_len, args.output_len)
        row = run_case(adapter, case, vocab, args.runs, 1)
        runs = [r["metrics"] for r in row["runs"]]
        rows.append({"concurrency": c, "decode_tok_s": round(row["decode_tok_s"], 1),
                     "ttft_s": round(row["ttft_s"], 4), "e2e_s": round(row["e2e_s"], 4),
                     "decode_runs_tok_s": [round(m["decode_tok_s"], 1) for m in runs],
                     "ttft_runs_s": [round(m["ttft_s"], 4) for m in runs],
                     "e2e_runs_s": [round(m["e2e_s"], 4) for m in runs]})
        print(f"{args.label} c={c}: decode {row['decode_tok_s']:.1f} tok/s (TTFT {row['ttft_s'] * 1e3:.1f} ms, "
              f"end to end {row['e2e_s'] * 1e3:.1f} ms)", flush=True)
    read_back = {f"{module}.{name}": plain(getattr(importlib.import_module(module), name))
                 for _, module, name, _ in module_constants(args.set)}
    print(json.dumps({"label": args.label, "rows": rows} | ({"constants": read_back} if read_back else {})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
