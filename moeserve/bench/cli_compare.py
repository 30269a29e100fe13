"""``moeserve compare A.json B.json``: two benchmark result files side by side.

Rows are matched by engine label, workload and concurrency (kernel results: by kernel, shape and
batch); each metric is shown for A and B with the ratio B/A. Rows only one file has are listed too.
"""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from moeserve.bench.report import fmt_metric, is_metric, load_result, metric_keys, row_key

KERNEL_METRICS = ("time_us", "gbps", "tflops", "max_error")


def _offline_rows(result: dict) -> dict[tuple, dict]:
    rows = {}
    for e in result.get("engines", []):
        for r in e.get("results", []):
            rows[(e.get("label", e.get("name")),) + row_key(r)] = r
    return rows


def _kernel_rows(result: dict) -> dict[tuple, dict]:
    return {(r.get("kernel"), r.get("shape"), r.get("batch")): r for r in result.get("kernels", [])}


def compare_rows(a: dict, b: dict, metrics: list[str] | None = None) -> list[dict]:
    """One dict per (row, metric): ``key``, ``metric``, ``a``, ``b`` and ``ratio`` (B/A, None if undefined)."""
    kernels = a.get("kind") == "kernels" or b.get("kind") == "kernels"
    ra, rb = (_kernel_rows(a), _kernel_rows(b)) if kernels else (_offline_rows(a), _offline_rows(b))
    keys = list(ra) + [k for k in rb if k not in ra]
    out = []
    for k in keys:
        x, y = ra.get(k, {}), rb.get(k, {})
        names = list(KERNEL_METRICS) if kernels else metric_keys([r for r in (x, y) if r])
        for m in names:
            if metrics and m not in metrics:
                continue
            va, vb = x.get(m), y.get(m)
            if not (is_metric(m, va) or is_metric(m, vb)):
                continue
            ratio = vb / va if is_metric(m, va) and is_metric(m, vb) and va else None
            out.append({"key": k, "metric": m, "a": va, "b": vb, "ratio": ratio})
    return out


def render_compare(a: dict, b: dict, name_a: str, name_b: str, metrics: list[str] | None = None) -> Table:
    kernels = a.get("kind") == "kernels" or b.get("kind") == "kernels"
    t = Table(title=f"A = {name_a}   B = {name_b}")
    for col in (("kernel", "shape", "batch") if kernels else ("engine", "workload", "c")):
        t.add_column(col)
    for col in ("metric", "A", "B", "B/A"):
        t.add_column(col, justify="right" if col != "metric" else "left")
    last = None
    for row in compare_rows(a, b, metrics):
        k = row["key"][:3]
        if last is not None and k != last:
            t.add_section()
        shown = [str(x) if x is not None else "" for x in k] if k != last else ["", "", ""]
        last = k
        fmt = (lambda m, v: "—" if v is None else f"{v:.4g}") if kernels else fmt_metric
        t.add_row(*shown, row["metric"], fmt(row["metric"], row["a"]), fmt(row["metric"], row["b"]),
                  "—" if row["ratio"] is None else f"{row['ratio']:.3f}x")
    return t


def run(args) -> int:
    a, b = load_result(args.a), load_result(args.b)
    if (a.get("kind") == "kernels") != (b.get("kind") == "kernels"):
        raise ValueError(f"cannot compare a {a.get('kind')!r} result with a {b.get('kind')!r} result")
    console = Console(width=args.width)
    console.print(render_compare(a, b, args.a, args.b, args.metric or None))
    for name, res in (("A", a), ("B", b)):
        for e in res.get("engines", []):
            if not e.get("available", True):
                console.print(f"{name}: {e.get('label')} unavailable: {e.get('reason')}")
    return 0


def register(subparsers, name: str, help_text: str) -> None:
    p = subparsers.add_parser(name, help=help_text, description=__doc__.split("\n\n")[0])
    p.add_argument("a", metavar="A.json", help="baseline result file")
    p.add_argument("b", metavar="B.json", help="result file compared against A")
    p.add_argument("--metric", action="append", default=[], help="only this metric (repeatable)")
    p.add_argument("--width", type=int, default=200, help="table width in characters")
    p.set_defaults(func=run)

