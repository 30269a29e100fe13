"""The engine, the server and the CLI run without the benchmark's extras (matplotlib, httpx, openai); a
feature that needs one says which package and extra to install."""
import subprocess
import sys

import pytest

from moeserve.deps import EXTRAS, MissingDependency, require

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("matplotlib", "httpx", "openai"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
"""


def test_require_names_the_package_and_the_extra(monkeypatch):
    assert require("json", "x").dumps(1) == "1"
    monkeypatch.setitem(EXTRAS, "no_such_module_xyz", ("no-such-package", "bench"))
    with pytest.raises(MissingDependency, match=r"^the plots: no-such-package is not installed; "
                                                r"pip install 'moeserve\[bench\]' \(or pip install no-such-package\)$"):
        require("no_such_module_xyz", "the plots")


def test_engine_server_and_cli_without_the_bench_extras(tmp_path):
    script = BLOCK + f"""
from moeserve.cli import main
import moeserve.server.app, moeserve.bench.cli  # importable without the extras
assert main(["generate", "tiny", "--device", "cpu", "--num-kv-pages", "16", "--max-model-len", "64",
             "--prompt-token-ids", "1,2,3", "--max-tokens", "2"]) == 0
from moeserve.bench.report import write_plots
from moeserve.deps import MissingDependency
try:
    write_plots({{"engines": [{{"label": "x", "results": [{{"workload": "decode", "concurrency": 1}}]}}]}},
                __import__("pathlib").Path({str(tmp_path)!r}), "r")
except MissingDependency as e:
    print("MISSING:", e)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "-> [" in r.stdout
    assert "MISSING: the benchmark's plots: matplotlib is not installed; pip install 'moeserve[bench]'" in r.stdout
