"""Decode A/B of several arms on one checkpoint: each arm a fresh ``scripts/decode_ab.py`` process (its engine
options, and optionally its own copy of the source tree), the arms alternating for ``--rounds`` rounds so that
a drift of the machine falls on all of them; then one table of each arm's mean decode tok/s per concurrency
against the first arm's.

    python scripts/ab_arms.py --model CKPT --concurrency 1 2 8 --rounds 2 \\
        --arm base --arm gemv4:linear_gemv_max_tokens=4 --arm fused:moe_fuse_shared_expert=true \\
        [--tree old=DIR --arm old@old] [--set kernel_cache_dir=fi-cache --set allow_jit=false] [--out ab.jsonl]

An arm is ``NAME[@TREE][:key=value,key=value...]``: ``@TREE`` runs it from the source tree registered with
``--tree TREE=DIR`` (a checkout of another commit: its ``moeserve`` package and its ``scripts/decode_ab.py``),
the options are its engine options on top of ``--set`` (each value read as YAML, as the CLI's ``--set``). A
kernel cache serves every arm when it was built from each arm's options and tree (``moeserve precompile`` into
one build directory, once per arm); with ``allow_jit=false`` an arm it does not cover is refused at start.
An option ``py.MODULE.NAME=VALUE`` sets a module constant of moeserve in the arm's process instead of an engine
option (``scripts/decode_ab.py``: an experiment's switch without a copy of the tree; with ``allow_jit=true`` where
it changes a Triton kernel).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_arm(spec: str) -> tuple[str, str | None, list[str]]:
    """``NAME[@TREE][:k=v,k=v]`` -> (name, tree or None, ["k=v", ...])."""
    head, _, opts = spec.partition(":")
    name, _, tree = head.partition("@")
    if not name:
        raise ValueError(f"arm {spec!r}: no name")
    sets = [kv for kv in opts.split(",") if kv]
    bad = [kv for kv in sets if "=" not in kv]
    if bad:
        raise ValueError(f"arm {spec!r}: {bad[0]!r} is not key=value")
    return name, tree or None, sets


def table(rows: list[dict], base: str) -> str:
    """Each arm's mean decode tok/s per concurrency over its rounds, and its change against ``base``."""
    rates: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        for x in r["rows"]:
            rates.setdefault(r["arm"], {}).setdefault(x["concurrency"], []).append(x["decode_tok_s"])
    cs = sorted({c for d in rates.values() for c in d})
    lines = ["arm".ljust(12) + "".join(f"c={c}".rjust(20) for c in cs)]
    for arm, d in rates.items():
        cells = []
        for c in cs:
            if c not in d:
                cells.append("—".rjust(20))
                continue
            m = statistics.mean(d[c])
            b = rates.get(base, {}).get(c)
            change = f" ({100 * (m / statistics.mean(b) - 1):+.1f}%)" if b and arm != base else ""
            cells.append(f"{m:,.1f}{change}".rjust(20))
        lines.append(arm.ljust(12) + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/ab_arms.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the checkpoint directory every arm loads")
    p.add_argument("--arm", action="append", required=True, help="NAME[@TREE][:key=value,...]; the first is the base")
    p.add_argument("--tree", action="append", default=[], help="TREE=DIR: a source tree arms can run from")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--runs", type=int, default=3, help="timed runs per concurrency in each process (the median)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--set", action="append", default=[], help="engine option key=value for every arm")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one arm's process may take")
    p.add_argument("--out", help="append each process's JSON line here")
    args = p.parse_args(argv)
    try:
        arms = [parse_arm(a) for a in args.arm]
        trees = dict(t.split("=", 1) for t in args.tree)
    except ValueError as e:
        p.error(str(e))
    for name, tree, _ in arms:
        if tree is not None and tree not in trees:
            p.error(f"arm {name!r} runs from tree {tree!r}, which no --tree names")
    rows = []
    for rnd in range(1, args.rounds + 1):
        for name, tree, sets in arms:
            root = Path(trees[tree]).resolve() if tree else REPO
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
            cmd = [sys.executable, str(root / "scripts" / "decode_ab.py"), "--model", args.model, "--runs",
                   str(args.runs), "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
                   "--label", f"{name}-{rnd}", "--concurrency", *map(str, args.concurrency)]
            for kv in args.set + sets:
                cmd += ["--set", kv]
            try:
                out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"{name} round {rnd}: no result within {args.timeout:.0f} s", flush=True)
                continue
            last = out.stdout.strip().splitlines()[-1:] if out.stdout.strip() else []
            if out.returncode != 0 or not last or not last[0].startswith("{"):
                said = (out.stderr or out.stdout).strip().splitlines() or ["no output"]
                print(f"{name} round {rnd}: exit {out.returncode}: {said[-1][:300]}", flush=True)
                continue
            row = json.loads(last[0]) | {"arm": name, "round": rnd, "tree": tree, "sets": sets}
            rows.append(row)
            print(f"{name} round {rnd}: " + ", ".join(f"c={x['concurrency']} {x['decode_tok_s']:.1f}"
                                                       for x in row["rows"]), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    if not rows:
        print("no arm gave a result")
        return 1
    print(table(rows, arms[0][0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
