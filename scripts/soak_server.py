"""Soak benchmark of ``moeserve serve``: does the server hold on to memory or KV pages under churn?

Starts the server as a subprocess (by default on a tiny random checkpoint with a word-level tokenizer,
CPU), fires ``--requests`` short requests at ``--concurrency``: streaming and non-streaming completions
and chats, clients that disconnect mid-stream or before a non-streaming answer, and malformed or
out-of-range requests. Meanwhile it samples the resident memory (/proc/PID/status VmRSS) of the HTTP
process and of its engine-core process, and ``moeserve_kv_pages_used`` from /metrics, prints them as a
table, and gives a verdict: KV pages must all be back once the server is idle, and neither process's RSS
after warm-up may keep growing.

    python scripts/soak_server.py --requests 3000 --concurrency 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hello", "max_tokens": '),
    ("/v1/completions", json.dumps({"prompt": "hello", "max_tokens": 0}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hello", "temperature": -1}).encode()),
    ("/v1/completions", json.dumps({"prompt": [1] * 400, "max_tokens": 4}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hello", "logprobs": 50}).encode()),
    ("/v1/completions", json.dumps({"prompt": "hello", "model": "unknown"}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": "hi", "top_p": 7}).encode()),
]
WORDS = "the quick brown fox jumps over the lazy dog hello world how are you today tell me a story".split()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(path: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from tokenizer_utils import make_tiny_model
    return make_tiny_model(path)


async def one_request(c: httpx.AsyncClient, rng: random.Random) -> str:
    """Send one request of a random kind; returns its outcome."""
    kind = rng.choices(["stream", "plain", "chat", "drop_stream", "drop_plain", "bad"],
                       weights=[35, 25, 15, 10, 5, 10])[0]
    if kind == "bad":
        path, body = rng.choice(BAD_REQUESTS)
        r = await c.post(path, content=body, headers={"content-type": "application/json"})
        return f"bad->{r.status_code}"
    max_tokens = rng.randint(2, 24)
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "stream": rng.random() < 0.5}
        r = await c.post("/v1/chat/completions", json=body)
        return f"chat->{r.status_code}"
    body = {"prompt": prompt if rng.random() < 0.5 else [rng.randrange(256) for _ in range(rng.randint(3, 60))],
            "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True}
    if rng.random() < 0.2:
        body |= {"logprobs": rng.randint(0, 5), "echo": rng.random() < 0.5}
    if kind in ("stream", "drop_stream"):
        async with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if kind == "drop_stream" and n >= 2:
                    return "dropped-stream"
        return f"stream->{r.status_code}"
    if kind == "drop_plain":
        try:
            await c.post("/v1/completions", json=body | {"max_tokens": 200}, timeout=httpx.Timeout(30, read=0.05))
        except httpx.ReadTimeout:
            return "dropped-plain"
        return "plain-finished-before-drop"
    r = await c.post("/v1/completions", json=body)
    return f"plain->{r.status_code}"


async def soak(args, url: str, pid: int, core_pid: int) -> tuple[list[dict], Counter]:
    outcomes: Counter = Counter()
    done = 0
    samples = []
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.concurrency)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        async def sample():
            page = (await c.get("/metrics")).text
            samples.append({"t": time.monotonic() - t0, "done": done, "rss": rss_bytes(pid), "core_rss": rss_bytes(core_pid),
                            "pages": metric(page, "moeserve_kv_pages_used"),
                            "running": metric(page, "moeserve_num_requests_running"),
                            "waiting": metric(page, "moeserve_num_requests_waiting")})

        async def sampler():
            while True:
                await asyncio.sleep(args.sample_every)
                await sample()

        async def worker(seed: int):
            nonlocal done
            async with sem:
                try:
                    outcomes[await one_request(c, random.Random(seed))] += 1
                except httpx.HTTPError as e:
                    outcomes[f"client error {type(e).__name__}"] += 1
                done += 1

        t0 = time.monotonic()
        await sample()
        task = asyncio.create_task(sampler())
        await asyncio.gather(*(worker(rng.randrange(1 << 30)) for _ in range(args.requests)))
        task.cancel()
        await asyncio.sleep(args.idle)  # let aborts land and the engine go idle
        await sample()
    return samples, outcomes


def verdict(samples: list[dict], requests: int) -> tuple[bool, list[str]]:
    lines, ok = [], True
    end = samples[-1]
    if end["pages"] == 0 and end["running"] == 0 and end["waiting"] == 0:
        lines.append("KV pages: all returned once idle (0 in use)")
    else:
        ok = False
        lines.append(f"KV pages: LEAK: {end['pages']:.0f} pages in use, {end['running']:.0f} running, "
                     f"{end['waiting']:.0f} waiting after the load stopped")
    warm = next((s for s in samples if s["done"] >= requests * 0.2), samples[0])
    late = [s for s in samples if s["done"] >= requests * 0.5]
    for key, name in (("rss", "HTTP process RSS"), ("core_rss", "engine core RSS")):
        growth = end[key] - warm[key]
        allowed = max(32 * MIB, 0.05 * warm[key])
        slope = 0.0
        if len(late) >= 3 and late[-1]["done"] > late[0]["done"]:
            slope = (late[-1][key] - late[0][key]) / (late[-1]["done"] - late[0]["done"]) * 1000
        lines.append(f"{name}: {warm[key] / MIB:.1f} MiB after warm-up ({warm['done']} requests) -> "
                     f"{end[key] / MIB:.1f} MiB at the end ({growth / MIB:+.1f} MiB; second half "
                     f"{slope / MIB:+.2f} MiB per 1000 requests)")
        if growth > allowed:
            ok = False
            lines.append(f"{name}: GROWTH beyond {allowed / MIB:.0f} MiB")
        else:
            lines.append(f"{name}: no growth beyond noise")
    return ok, lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--model", help="model directory (default: a tiny random checkpoint made here)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--idle", type=float, default=2.0, help="seconds to wait after the load before the last sample")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="moeserve-soak-")
    model = args.model or str(tiny_model(Path(tmp.name) / "tiny"))
    port = free_port()
    cmd = [sys.executable, "-m", "moeserve.server.cli", "--model", model, "--device", args.device,
           "--port", str(port), "--served-model-name", "soak", "--max-num-seqs", "32", "--max-model-len", "256",
           "--num-kv-pages", "600", "--page-size", "16", "--max-queue-len", "512", "--enforce-eager"]
    if args.device == "cpu":
        cmd += ["--dtype", "float32"]
    server = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                print(f"the server exited with {server.returncode}", file=sys.stderr)
                return 1
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                print("the server did not come up", file=sys.stderr)
                return 1
            time.sleep(0.5)
        core_pid = httpx.get(url + "/server_info", timeout=10).json()["engine"]["pid"]
        t0 = time.monotonic()
        samples, outcomes = asyncio.run(soak(args, url, server.pid, core_pid))
        wall = time.monotonic() - t0
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        tmp.cleanup()

    print(f"\n{args.requests} requests at concurrency {args.concurrency} in {wall:.1f} s")
    print(f"{'t (s)':>7} {'requests':>9} {'HTTP RSS':>9} {'core RSS':>9} {'pages used':>11} {'running':>8} "
          f"{'waiting':>8}   (RSS in MiB)")
    for s in samples:
        print(f"{s['t']:7.1f} {s['done']:9d} {s['rss'] / MIB:9.1f} {s['core_rss'] / MIB:9.1f} {s['pages']:11.0f} "
              f"{s['running']:8.0f} {s['waiting']:8.0f}")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    ok, lines = verdict(samples, args.requests)
    for line in lines:
        print(line)
    print("verdict: " + ("OK, no growth" if ok else "GROWTH or LEAK (see above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
