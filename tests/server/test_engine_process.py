"""The engine core runs in a child process of the server: its pid differs from the HTTP process's and its
parent is the HTTP process; when it dies, /health turns 503 and every open stream ends with an error
within seconds (no hang), and new requests are refused with 503."""
import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from moeserve.server.cli import BackgroundServer, build_server
from test_server import tiny_config
from tokenizer_utils import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_core"))


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_the_engine_runs_in_a_child_process(model_dir):
    with BackgroundServer(build_server(tiny_config(model_dir))) as srv:
        info = httpx.get(srv.url + "/server_info").json()
        core = info["engine"]["pid"]
        assert core != os.getpid() and info["front_end_pid"] == os.getpid()
        assert parent_of(core) == os.getpid(), "the engine core is a child of the HTTP process"
        assert srv.app.state.server.client.pid == core
        assert info["engine"]["gc_frozen_objects"] > 10_000, "the startup heap is frozen out of collections"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 10
    while Path(f"/proc/{core}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{core}").exists(), "the engine core stops with the server"


async def _open_stream(client: httpx.AsyncClient, url: str, started: asyncio.Event, n: list) -> dict:
    body = {"prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True, "stream": True}
    last = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
                if "choices" in last:
                    n[0] += 1
                    if n[0] >= 4:
                        started.set()
    return last


def test_killing_the_engine_fails_open_streams_and_health(model_dir):
    with BackgroundServer(build_server(tiny_config(model_dir))) as srv:
        client = srv.app.state.server.client

        async def main():
            started, n = asyncio.Event(), [0]
            async with httpx.AsyncClient(timeout=30) as c:
                streams = [asyncio.create_task(_open_stream(c, srv.url, started, n)) for _ in range(4)]
                await asyncio.wait_for(started.wait(), 30)
                t0 = time.monotonic()
                os.kill(client.pid, signal.SIGKILL)
                lasts = await asyncio.wait_for(asyncio.gather(*streams), 10)
                return lasts, time.monotonic() - t0

        lasts, took = asyncio.run(main())
        assert took < 5, f"the open streams took {took:.1f} s to end"
        for last in lasts:
            assert last["error"]["code"] == "engine_dead" and "exited" in last["error"]["message"], last
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "exit code -9" in health.json()["error"]
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
        m = httpx.get(srv.url + "/metrics").text
        assert 'moeserve_requests_total{model_name="tiny-moe",outcome="error"} 4.0' in m


def test_a_non_streaming_request_gets_an_error_when_the_engine_dies(model_dir):
    with BackgroundServer(build_server(tiny_config(model_dir))) as srv:
        client = srv.app.state.server.client

        async def main():
            async with httpx.AsyncClient(timeout=30) as c:
                task = asyncio.create_task(c.post(srv.url + "/v1/completions", json={
                    "prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True}))
                while client.load()["running"] == 0:
                    await asyncio.sleep(0.01)
                os.kill(client.pid, signal.SIGKILL)
                return await asyncio.wait_for(task, 10)

        r = asyncio.run(main())
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
