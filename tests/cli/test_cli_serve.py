"""moeserve serve tiny --port P, as the quick start says: it answers /v1/models and a completion, and stops
on Ctrl+C."""
import signal
import socket
import subprocess
import sys
import time

import httpx

from cli_utils import cli_env, default_sigint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_tiny_on_a_port_answers():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moeserve.cli", "serve", "tiny", "--port", str(port),
                             "--device", "cpu", "--max-model-len", "256", "--num-kv-pages", "64"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=cli_env(),
                            preexec_fn=default_sigint)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        models = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                models = httpx.get(url + "/v1/models", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.5)
        assert models is not None and models.status_code == 200, proc.stderr.read() if proc.poll() else "no answer"
        assert models.json()["data"][0]["id"] == "tiny"
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4,
                                                      "ignore_eos": True}, timeout=60)
        usage = r.json()["usage"]
        assert r.status_code == 200 and (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 4)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
