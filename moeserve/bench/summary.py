"""The machine-readable headline: ``docs/results/summary.json`` from one offline benchmark result, and the
README's results table generated from it.

    python -m moeserve.bench.summary RESULT.json --out docs/results/summary.json --results-dir DIR \\
        [--readme README.md]

The summary names the GPU, date, versions, commit, model and weights (``shared-checkpoint`` when every engine
loaded the same files), the copy bandwidth the roofline fractions are relative to, and for each workload and
concurrency each engine's decode tok/s, TTFT and roofline fraction. ``--readme`` rewrites the block between
``<!-- results-table:start -->`` and ``<!-- results-table:end -->``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"
METRICS = ("decode_tok_s", "ttft_s", "prefill_tok_s", "total_tok_s", "roofline_fraction")


def _engine_key(e: dict) -> str:
    return "moeserve" if e["name"] == "moeserve" else e["label"]


def summarize(result: dict, results_dir: str | None = None) -> dict:
    """The headline of an offline ``result`` (``moeserve bench``'s result.json)."""
    env = result.get("environment", {})
    gpus = env.get("gpus") or []
    versions = dict(env.get("versions") or {})
    for e in result["engines"]:
        if e.get("versions"):
            versions.update({k: v for k, v in e["versions"].items() if v})
    workloads: dict[str, dict[str, dict]] = {}
    engines = []
    for e in result["engines"]:
        if not e.get("available"):
            continue
        key = _engine_key(e)
        if key not in [x["engine"] for x in engines]:  # one engine may come from several merged results
            engines.append({"engine": key, "backends": e.get("backends", {}), "start_seconds": e.get("start_seconds")})
        for row in e.get("results", []):
            cell = workloads.setdefault(row["workload"], {}).setdefault(str(row["concurrency"]), {})
            cell[key] = {m: row[m] for m in METRICS if m in row}
    b = result.get("config", {}).get("bench", {})
    bandwidth = (result.get("roofline") or {}).get("bandwidth_bytes_per_s")
    return {
        "gpu": gpus[0]["name"] if gpus else env.get("cpu"), "date": result["created"][:10],
        "created": result["created"], "commit": result.get("commit"), "command": result.get("command"),
        "versions": {k: versions.get(k) for k in ("torch", "triton", "flashinfer", "vllm", "python") if k in versions},
        "driver": env.get("driver_version"), "model": result["model"],
        "weights": result.get("weights", "dummy"), "prompt_len": b.get("prompt_len"), "output_len": b.get("output_len"),
        "runs": b.get("runs"), "engines": engines, "results_dir": results_dir, "workloads": workloads,
        # the roofline fractions' denominator: this run's measured copy bandwidth (it differs between GPUs of a kind)
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1) if bandwidth else None,
    }


def _fmt(v, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "tok":
        return f"{v:,.0f}"
    if kind == "ms":
        return f"{v * 1000:.1f}"
    return f"{v * 100:.1f}%"  # one decimal: a target of 90% is not met at 89.6%


def markdown_table(summary: dict, workload: str = "decode") -> str:
    """One row per concurrency: each engine's decode tok/s, TTFT and roofline fraction, and the ratio."""
    cells = summary["workloads"].get(workload, {})
    names = [e["engine"] for e in summary["engines"]]
    others = [n for n in names if n != "moeserve"]
    head = ["c", "moeserve decode tok/s"] + [f"{n} decode tok/s" for n in others]
    head += [f"moeserve / {n}" for n in others] + ["moeserve TTFT ms"] + [f"{n} TTFT ms" for n in others]
    head += ["moeserve roofline"] + [f"{n} roofline" for n in others]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for c in sorted(cells, key=int):
        cell = cells[c]
        get = lambda n, m: cell.get(n, {}).get(m)  # noqa: E731
        ours = get("moeserve", "decode_tok_s")
        row = [c, _fmt(ours, "tok")] + [_fmt(get(n, "decode_tok_s"), "tok") for n in others]
        row += [f"{ours / get(n, 'decode_tok_s'):.2f}" if ours and get(n, "decode_tok_s") else "-" for n in others]
        row += [_fmt(get("moeserve", "ttft_s"), "ms")] + [_fmt(get(n, "ttft_s"), "ms") for n in others]
        row += [_fmt(get("moeserve", "roofline_fraction"), "frac")]
        row += [_fmt(get(n, "roofline_fraction"), "frac") for n in others]
        lines.append("| " + " | ".join(row) + " |")
    v = summary["versions"]
    commit = str(summary["commit"])
    if re.fullmatch(r"[0-9a-f]{40}", commit):  # a full hash: its short form, as git log --oneline names it
        commit = commit[:7]
    caption = (f"{summary['gpu']}, {summary['date']}, commit `{commit}`; "
               f"{summary['model']['name']} ({summary['model']['dtype']}), weights: {summary['weights']}; "
               f"{summary['prompt_len']}-token prompts, {summary['output_len']} output tokens, greedy, median of "
               f"{summary['runs']} runs; " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
    if summary.get("copy_bandwidth_gb_s"):
        caption += f"; roofline at the copy bandwidth measured in the run, {summary['copy_bandwidth_gb_s']:,.0f} GB/s"
    return caption + "\n\n" + "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    if START not in text or END not in text:
        raise ValueError(f"the README has no {START} ... {END} block to replace")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moeserve.bench.summary", description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="an offline result.json written by moeserve bench")
    p.add_argument("--out", required=True, help="where to write summary.json")
    p.add_argument("--results-dir", help="the results page the summary points to (stored in it)")
    p.add_argument("--readme", help="rewrite the results table block of this README from the summary")
    args = p.parse_args(argv)
    result = json.loads(Path(args.result).read_text())
    if result.get("kind") != "offline":
        print(f"error: {args.result} is not an offline benchmark result (kind {result.get('kind')!r})", file=sys.stderr)
        return 2
    summary = summarize(result, args.results_dir)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    if args.readme:
        path = Path(args.readme)
        path.write_text(replace_block(path.read_text(), markdown_table(summary)))
    print(markdown_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
