"""Running the real command line in a subprocess, with this checkout's moeserve on its path; loading the
checkout's ``scripts/`` as modules."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """``scripts/<name>.py`` of this checkout, imported as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cli_env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.update(extra)
    return env


def default_sigint() -> None:
    """``preexec_fn`` of a child a test will Ctrl+C: SIGINT at its default, as under a terminal. A shell's
    background job (``make test &``) ignores SIGINT, children inherit that, and Python keeps an inherited
    ignore, so the test would otherwise depend on how the suite was started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(args, env=None, timeout=180) -> subprocess.CompletedProcess:
    """``python -m moeserve.cli ARGS``, its output captured."""
    return subprocess.run([sys.executable, "-m", "moeserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or cli_env())
