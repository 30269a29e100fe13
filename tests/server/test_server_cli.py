"""``moeserve serve`` as users start it: a subprocess that prints its URL and backends once ready, takes
its settings from flags and the config's server section, stops cleanly on Ctrl+C, drains running requests
on SIGTERM, and reports a port in use in one line before loading anything."""
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from cli_utils import default_sigint
from tokenizer_utils import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_cli"))


def serve_cmd(model_dir, *extra):
    return [sys.executable, "-m", "moeserve.cli", "serve", "--model", str(model_dir), "--device", "cpu",
            "--dtype", "float32", "--num-kv-pages", "64", "--page-size", "8", "--max-model-len", "128", *extra]


def test_serve_prints_url_and_backends_and_stops_on_ctrl_c(model_dir):
    proc = subprocess.Popen(serve_cmd(model_dir, "--port", "0", "--served-model-name", "cli-model", "--api-key",
                                      "k1", "--set", "server.max_queue_len=5"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=default_sigint)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("moeserve: backends"):
                break
        out = "".join(lines)
        m = re.search(r"serving 'cli-model' at (http://127\.0\.0\.1:\d+)/v1", out)
        assert m, out
        assert "moe=torch" in out and "attention=torch" in out
        assert "PDL" not in lines[-1] and "no PDL" in out  # the CPU launches no kernel with PDL
        url = m.group(1)
        auth = {"Authorization": "Bearer k1"}
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "cli-model"
        info = httpx.get(url + "/server_info", headers=auth).json()
        assert info["load"]["max_queue_len"] == 5 and info["engine"]["kv_pages"] == 63
        assert info["engine"]["pdl_max_tokens"] == 0
        r = httpx.post(url + "/v1/completions", headers=auth, json={"prompt": [1, 2, 3], "max_tokens": 3,
                                                                    "ignore_eos": True}, timeout=60)
        assert r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_serve_rejects_a_bad_server_setting_by_name(model_dir):
    r = subprocess.run(serve_cmd(model_dir, "--port", "70000"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "server.port" in r.stderr


def test_a_port_in_use_is_one_line_before_anything_loads(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run(serve_cmd(model_dir, "--port", str(port)), capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2  # a user error, as every other (moeserve.cli)
    assert len(lines) == 1 and "already in use" in lines[0] and str(port) in lines[0], r.stderr
    assert "Traceback" not in r.stderr and "starting the engine" not in r.stdout, "failed before loading the model"
    assert time.monotonic() - t0 < 60


DRAIN_TOKENS = 300  # generated after SIGTERM arrives: the drain must finish them, however slow the machine


def _read_stream(url: str, out: dict, first: threading.Event) -> None:
    body = {"prompt": [4, 5, 6], "max_tokens": DRAIN_TOKENS, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out["events"].append(line[6:])
                first.set()


def test_sigterm_drains_running_requests_then_exits(model_dir):
    proc = subprocess.Popen(serve_cmd(model_dir, "--port", "0", "--max-model-len", "512", "--num-kv-pages", "100",
                                      "--set", "server.shutdown_timeout=300"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and url is None:
            line = proc.stdout.readline()
            m = re.search(r"serving .* at (http://[^/]+)/v1", line)
            url = m.group(1) if m else None
        assert url, "the server did not start"
        core = httpx.get(url + "/server_info").json()["engine"]["pid"]
        out, first = {"events": []}, threading.Event()
        reader = threading.Thread(target=_read_stream, args=(url, out, first))
        reader.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        got_at_term = len(out["events"])
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # no new connections while draining
            httpx.get(url + "/health", timeout=5)
        reader.join(300)
        assert proc.wait(300) == 0
        events = out["events"]
        assert got_at_term < DRAIN_TOKENS and events[-1] == "[DONE]", "the stream was cut short"
        tokens = sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in events[:-1])
        assert tokens == DRAIN_TOKENS
        assert not Path(f"/proc/{core}").exists(), "the engine core exited too"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
