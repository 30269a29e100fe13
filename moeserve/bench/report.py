"""Benchmark results: the side-by-side terminal table, the JSON file, a markdown and a text table, and
plots of throughput and TTFT against concurrency.

A result is a dict (schema in the project brief): ``kind``, ``environment``, ``config``, ``model`` and
``engines``, each engine with ``results`` rows (``workload``, ``concurrency``, metric keys, raw
``runs``). Kernel results (``kind: "kernels"``) keep their rows in ``result["kernels"]`` instead. The
rendering is generic over whichever metric keys the rows have.
"""
from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROW_ID_KEYS = ("workload", "concurrency", "request_rate")
NON_METRIC_KEYS = set(ROW_ID_KEYS) | {"prompt_len", "output_len", "runs", "num_prompts", "max_concurrency"}
METRIC_ORDER = ("decode_tok_s", "prefill_tok_s", "total_tok_s", "output_tok_s", "request_throughput", "ttft_s",
                "e2e_s", "roofline_fraction", "distinct_token_frac", "prefix_hit_rate", "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms", "tpot_mean_ms",
                "tpot_median_ms", "tpot_p99_ms", "itl_mean_ms", "itl_median_ms", "itl_p99_ms", "e2el_mean_ms",
                "e2el_median_ms", "e2el_p99_ms")
MAIN_METRICS = {"prefill": ("ttft_s", "prefill_tok_s"),
                "decode": ("decode_tok_s", "ttft_s", "total_tok_s", "roofline_fraction", "distinct_token_frac"),
                "mixed": ("total_tok_s", "output_tok_s", "ttft_s"),
                "shared-prefix": ("total_tok_s", "ttft_s", "prefix_hit_rate")}
THROUGHPUT_KEYS = ("decode_tok_s", "prefill_tok_s", "total_tok_s", "output_tok_s", "request_throughput")
TTFT_KEYS = ("ttft_s", "ttft_median_ms", "ttft_mean_ms")
KERNEL_COLUMNS = (("kernel", "kernel"), ("shape", "shape"), ("batch", "batch"), ("time_us", "time µs"),
                  ("gbps", "GB/s"), ("tflops", "TFLOP/s"), ("max_error", "max err"), ("status", "status"))


def is_metric(key: str, value) -> bool:
    return key not in NON_METRIC_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool)


def row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ROW_ID_KEYS)


def metric_keys(rows: list[dict], main_only: bool = False) -> list[str]:
    keys: set[str] = set()
    for r in rows:
        keys |= {k for k, v in r.items() if is_metric(k, v)}
    if main_only:
        workloads = {r.get("workload") for r in rows}
        if workloads <= set(MAIN_METRICS):
            keys &= {k for w in workloads for k in MAIN_METRICS[w]}
    return sorted(keys, key=lambda k: (METRIC_ORDER.index(k) if k in METRIC_ORDER else len(METRIC_ORDER), k))


def fmt_metric(key: str, value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if key in ("roofline_fraction", "distinct_token_frac", "prefix_hit_rate"):
        return f"{value:.1%}"
    if key.endswith("tok_s"):
        return f"{value:,.0f} tok/s" if value >= 100 else f"{value:.2f} tok/s"
    if key == "request_throughput":
        return f"{value:.3g} req/s"
    if key.endswith("_ms"):
        return f"{value:.2f} ms"
    if key.endswith("_s"):
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.3f} s"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def fmt_bytes(n) -> str:
    return "—" if n is None else f"{n / (1 << 30):.2f} GiB"


def _engines(result: dict) -> list[dict]:
    return result.get("engines", [])


def _table_rows(result: dict, main_only: bool):
    """(workload, concurrency, metric, [value per engine]) in report order."""
    engines = _engines(result)
    index = [{row_key(r): r for r in e.get("results", [])} for e in engines]
    keys = []
    for e in engines:
        for r in e.get("results", []):
            if row_key(r) not in keys:
                keys.append(row_key(r))
    out = []
    for k in keys:
        rows = [ix[k] for ix in index if k in ix]
        for m in metric_keys(rows, main_only):
            out.append((k, m, [ix.get(k, {}).get(m) for ix in index]))
    return out


def _header(e: dict) -> str:
    return e.get("label", e.get("name", "?")) + ("" if e.get("available", True) else " (unavailable)")


def render_table(result: dict, main_only: bool = True) -> Table:
    """Rows: workload x concurrency x metric; columns: one per engine, then each engine / the first one."""
    if result.get("kind") == "kernels":
        return render_kernels(result)
    engines = _engines(result)
    t = Table(title=f"moeserve bench ({result.get('kind', '?')}): {result.get('model', {}).get('name', '')}",
              show_lines=False)
    for col in ("workload", "c", "metric"):
        t.add_column(col)
    for e in engines:
        t.add_column(_header(e), justify="right")
    base = next((i for i, e in enumerate(engines) if e.get("available", True) and e.get("results")), None)
    others = [i for i, e in enumerate(engines) if i != base and e.get("available", True)] if base is not None else []
    for i in others:
        t.add_column(f"{engines[i].get('label')}/{engines[base].get('label')}", justify="right")
    last = None
    for key, metric, values in _table_rows(result, main_only):
        if last is not None and key != last:
            t.add_section()
        first = key != last
        last = key
        cells = [str(key[0]) if first else "", str(key[1]) if first and key[1] is not None else "", metric]
        cells += [fmt_metric(metric, v) for v in values]
        for i in others:
            a, b = values[base], values[i]
            cells.append(f"{b / a:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a
                         else "—")
        t.add_row(*cells)
    return t


def render_engines(result: dict) -> Table:
    t = Table(title="engines")
    for col in ("engine", "status", "start", "weights", "KV cache", "peak activations", "backends"):
        t.add_column(col)
    for e in _engines(result):
        mem = e.get("memory") or {}
        status = "ok" if e.get("available", True) else f"unavailable: {e.get('reason')}"
        start = e.get("start_seconds")
        t.add_row(e.get("label", ""), status, "—" if start is None else f"{start:.1f} s",
                  fmt_bytes(mem.get("weights_bytes")), fmt_bytes(mem.get("kv_cache_bytes")),
                  fmt_bytes(mem.get("activation_peak_bytes")),
                  " ".join(f"{k}={v}" for k, v in (e.get("backends") or {}).items()))
    return t


def render_kernels(result: dict) -> Table:
    t = Table(title=f"moeserve bench kernels: {result.get('model', {}).get('name', '')}")
    for _, title in KERNEL_COLUMNS:
        t.add_column(title)
    for r in result.get("kernels", []):
        t.add_row(*[_kernel_cell(r, k) for k, _ in KERNEL_COLUMNS])
    return t


def _kernel_cell(r: dict, key: str) -> str:
    v = r.get(key)
    if key == "status" and r.get("reason"):
        return f"{v}: {r['reason']}"
    if v is None:
        return "—"
    if key == "max_error":
        return f"{v:.2e}"
    if isinstance(v, float):
        return f"{v:,.1f}" if v >= 10 else f"{v:.3f}"
    return str(v)


def print_result(result: dict, console: Console | None = None) -> None:
    console = console or Console(width=200)
    console.print(render_table(result))
    if result.get("kind") != "kernels" and _engines(result):
        console.print(render_engines(result))
        for e in _engines(result):
            if not e.get("available", True):
                console.print(f"[bold red]{e.get('label')}[/] unavailable: {e.get('reason')}")
    roof = result.get("roofline") or {}
    if "error" in roof:
        console.print(f"roofline: not measured ({roof['error']})")
    if "per_concurrency" in roof:
        console.print(f"roofline: copy bandwidth {roof['bandwidth_bytes_per_s'] / 1e9:,.0f} GB/s "
                      f"({roof['bandwidth_method']}); decode ceilings: " + ", ".join(
                          f"c={r['concurrency']}: {r['ceiling_decode_tok_s']:,.0f} tok/s"
                          for r in roof.get("per_concurrency", [])))


def _md_escape(s) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def markdown(result: dict) -> str:
    """The whole result as markdown: every metric, the engines, the roofline."""
    env = result.get("environment", {})
    gpu = (env.get("gpus") or [{}])[0].get("name", env.get("device_type", "?"))
    lines = [f"# moeserve bench ({result.get('kind')}): {result.get('model', {}).get('name', '')}", "",
             f"{result.get('created', '')} · {gpu} · `{result.get('command', '')}`", ""]
    if result.get("kind") == "kernels":
        lines += ["| " + " | ".join(t for _, t in KERNEL_COLUMNS) + " |", "|" + "---|" * len(KERNEL_COLUMNS)]
        for r in result.get("kernels", []):
            lines.append("| " + " | ".join(_md_escape(_kernel_cell(r, k)) for k, _ in KERNEL_COLUMNS) + " |")
        return "\n".join(lines) + "\n"
    engines = _engines(result)
    lines += ["| workload | c | metric | " + " | ".join(_md_escape(_header(e)) for e in engines) + " |",
              "|---|---|---|" + "---|" * len(engines)]
    for key, metric, values in _table_rows(result, main_only=False):
        lines.append(f"| {key[0]} | {'' if key[1] is None else key[1]} | {metric} | "
                     + " | ".join(fmt_metric(metric, v) for v in values) + " |")
    lines += ["", "| engine | status | start | weights | KV cache | peak activations | backends |",
              "|---|---|---|---|---|---|---|"]
    for e in engines:
        mem = e.get("memory") or {}
        start = e.get("start_seconds")
        lines.append("| " + " | ".join(_md_escape(x) for x in (
            e.get("label"), "ok" if e.get("available", True) else f"unavailable: {e.get('reason')}",
            "—" if start is None else f"{start:.1f} s", fmt_bytes(mem.get("weights_bytes")),
            fmt_bytes(mem.get("kv_cache_bytes")), fmt_bytes(mem.get("activation_peak_bytes")),
            ", ".join(f"{k}={v}" for k, v in (e.get("backends") or {}).items()))) + " |")
    for e in engines:
        if e.get("notes"):
            lines += ["", f"Notes for {e.get('label')}:"] + [f"- {_md_escape(n)}" for n in e["notes"]]
    roof = result.get("roofline") or {}
    if "per_concurrency" in roof:
        lines += ["", f"Roofline: copy bandwidth {roof['bandwidth_bytes_per_s'] / 1e9:,.0f} GB/s "
                      f"({roof['bandwidth_method']}).", "",
                  "| c | context | bytes/step | floor step | ceiling decode tok/s |", "|---|---|---|---|---|"]
        for r in roof.get("per_concurrency", []):
            lines.append(f"| {r['concurrency']} | {r['context_len']:.0f} | {r['bytes']['total'] / 1e9:.3f} GB | "
                         f"{r['floor_step_s'] * 1e6:.1f} µs | {r['ceiling_decode_tok_s']:,.0f} |")
    return "\n".join(lines) + "\n"


def write_plots(result: dict, out_dir: Path, stem: str) -> dict[str, str]:
    """Throughput and TTFT against concurrency, one line per engine, one panel per workload."""
    rows = [(e, r) for e in _engines(result) for r in e.get("results", []) if r.get("concurrency") is not None]
    if not rows:
        return {}
    from moeserve.deps import require
    matplotlib = require("matplotlib", "the benchmark's plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    workloads = list(dict.fromkeys(r.get("workload") for _, r in rows))
    paths = {}
    for name, candidates in (("throughput", THROUGHPUT_KEYS), ("ttft", TTFT_KEYS)):
        fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
        drawn = False
        for ax, w in zip(axes[0], workloads):
            ws = [r for _, r in rows if r.get("workload") == w]
            metric = next((k for k in candidates if any(is_metric(k, r.get(k)) for r in ws)), None)
            if metric is None:
                ax.set_visible(False)
                continue
            for e in _engines(result):
                pts = sorted((r["concurrency"], r[metric]) for r in e.get("results", [])
                             if r.get("workload") == w and is_metric(metric, r.get(metric)))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=e.get("label"))
                    drawn = True
            ax.set_xscale("log", base=2)
            cs = sorted({r["concurrency"] for r in ws})
            ax.set_xticks(cs, [str(c) for c in cs])
            ax.set_ylim(bottom=0)
            ax.set_title(f"{w}: {metric}")
            ax.set_xlabel("concurrency")
            ax.set_ylabel(metric)
            ax.grid(True, alpha=0.3)
            ax.legend()
        if drawn:
            path = out_dir / f"{stem}-{name}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            paths[f"{name}_png"] = str(path)
        plt.close(fig)
    return paths


def write_json(result: dict, path: Path) -> None:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)


def write_result(result: dict, out_dir, stem: str = "result") -> dict[str, str]:
    """Write ``<stem>.json``, ``<stem>.md``, ``<stem>.txt`` and the plots; returns their paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / f"{stem}.json"), "markdown": str(out / f"{stem}.md"), "text": str(out / f"{stem}.txt")}
    write_json(result, Path(paths["json"]))
    Path(paths["markdown"]).write_text(markdown(result))
    console = Console(record=True, width=200, file=io.StringIO())
    print_result(result, console)
    Path(paths["text"]).write_text(console.export_text())
    if result.get("kind") != "kernels" and result.get("config", {}).get("bench", {}).get("plots", True):
        from moeserve.deps import MissingDependency
        try:
            paths.update(write_plots(result, out, stem))
        except MissingDependency as e:  # the tables and JSON stand without the plots
            print(f"bench: no plots: {e}", file=sys.stderr, flush=True)
    return paths


def load_result(path) -> dict:
    """Read a result file; refuses files that are not benchmark results."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"result file {str(p)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"result file {str(p)!r} is not JSON: {e}") from None
    if not isinstance(data, dict) or "kind" not in data or not ("engines" in data or "kernels" in data):
        raise ValueError(f"result file {str(p)!r} is not a moeserve benchmark result (no kind/engines)")
    return data
