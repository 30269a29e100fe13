"""``moeserve serve`` as users start it: a subprocess that prints its URL and backends once ready, takes
its settings from flags and the config's server section, and stops cleanly on Ctrl+C."""
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

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
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        url = m.group(1)
        auth = {"Authorization": "Bearer k1"}
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "cli-model"
        info = httpx.get(url + "/server_info", headers=auth).json()
        assert info["load"]["max_queue_len"] == 5 and info["engine"]["kv_pages"] == 63
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
