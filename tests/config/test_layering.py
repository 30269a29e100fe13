"""The house rules of the package: no import circle among moeserve modules (imports inside functions
included), and every import points down the layers: config/hardware -> quant -> kernel-cache runtime -> ops
-> models -> weights/plan -> engine -> server, bench, tools -> cli."""
import ast
from pathlib import Path

import moeserve

ROOT = Path(moeserve.__file__).resolve().parent

# Lowest first; a module may import modules of its own layer or of a lower one.
LAYERS = [
    ("config", ["moeserve", "moeserve.deps", "moeserve.config", "moeserve.hardware", "moeserve.backends", "moeserve.args",
                "moeserve.hub", "moeserve.progress"]),
    ("quant", ["moeserve.quant"]),
    ("kernel-cache runtime", ["moeserve.kernel_cache"]),
    ("ops", ["moeserve.ops"]),
    ("models", ["moeserve.models"]),
    ("weights and plan", ["moeserve.weights", "moeserve.weight_reader", "moeserve.plan"]),
    ("engine", ["moeserve.engine"]),
    ("server, bench, tools", ["moeserve.server", "moeserve.bench", "moeserve.tools"]),
    ("cli", ["moeserve.cli", "moeserve.preflight"]),
]


def modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = ["moeserve", *p.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The moeserve modules ``name`` imports anywhere in its file (a ``from pkg import sub`` counts as ``sub``)."""
    is_pkg = path.name == "__init__.py"
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("moeserve"):
                deps.add(t)
    return deps


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def layer_of(name: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best_len and not (p == "moeserve" and name != p):
                best, best_len = i, len(p)
    assert best is not None, f"{name} is in no layer of LAYERS; place it"
    return best


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path):
    g = {"moeserve.ops.a": {"moeserve.engine.b"}, "moeserve.engine.b": {"moeserve.ops.a"}}
    assert cycles(g) == [["moeserve.engine.b", "moeserve.ops.a"]]
    assert layer_of("moeserve.engine.b") > layer_of("moeserve.ops.a")
    known = {"moeserve.ops": ROOT, "moeserve.ops.kv_cache": ROOT, "moeserve.cli": ROOT}
    src = "def f():\n    from moeserve.ops import kv_cache\n    import moeserve.cli\n"
    probe = tmp_path / "probe.py"
    probe.write_text(src)
    assert imports_of("moeserve.x", probe, known) == {"moeserve.ops.kv_cache", "moeserve.cli"}


def test_no_import_circle_among_moeserve_modules():
    assert cycles(graph()) == []


def test_every_import_points_down_the_layers():
    upward = []
    for name, deps in graph().items():
        for d in deps:
            if layer_of(d) > layer_of(name):
                upward.append(f"{name} ({LAYERS[layer_of(name)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})")
    assert upward == []
