"""The server's own packages missing, and a server that never gets ready under ``bench serving``: one line that
says so, not an import traceback, and the serving benchmark stops before its offline runs, not after them."""
import sys

import pytest

from moeserve import cli
from moeserve.bench import serving_overhead
from moeserve.config import make_config


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_serve_without_pyzmq_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "zmq", None)  # import zmq fails as where pyzmq is not installed
    assert cli.main(["serve", "tiny", "--device", "cpu", "--port", "0"]) == 2
    assert one_line(capsys) == "error: moeserve serve: pyzmq is not installed; pip install pyzmq"


def test_bench_serving_without_pyzmq_stops_before_the_offline_runs(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "zmq", None)
    monkeypatch.setattr(serving_overhead, "run_offline", lambda *a: pytest.fail("the offline runs started"))
    assert cli.main(["bench", "serving", "--model", "tiny", "--device", "cpu", "--input-len", "8",
                     "--output-len", "4", "--max-concurrency", "1"]) == 2
    assert "moeserve bench serving (it starts moeserve serve): pyzmq is not installed" in one_line(capsys)


@pytest.mark.parametrize("script, timeout, message", [
    ("echo loading; echo oops >&2; exit 3", 30.0, "moeserve serve exited with code 3 before it was ready"),
    ("echo loading; sleep 30", 1.0, "moeserve serve was not ready after 1 s (--server-timeout)"),
])
def test_a_server_that_is_never_ready_is_named(tmp_path, monkeypatch, script, timeout, message):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(serving_overhead.sys, "executable", str(fake))
    with pytest.raises(serving_overhead.ServerStartError, match=message.replace("(", r"\(").replace(")", r"\)")):
        serving_overhead.start_server(make_config(device="cpu"), timeout)
    assert isinstance(serving_overhead.ServerStartError("x"), cli.user_error_types())  # one line from the CLI
