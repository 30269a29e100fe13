"""``moeserve bench serving``: what the HTTP server adds over the engine, in one run on one model.

The same request stream three ways, at each ``--max-concurrency`` level (default 1, 8, 32):

1. offline: the ``LLMEngine`` in this process, driven as a closed loop of ``c`` requests in flight (a new
   one added as soon as one finishes), each request's first token and token gaps timed as the engine
   hands them out;
2. online: ``moeserve serve`` on the same config in a child process (engine core in its own process),
   loaded by ``moeserve bench online``'s client (vLLM ``bench serve`` definitions: streaming, token-id
   prompts, ignore_eos, greedy);
3. with ``--vllm-url``: the same client against a vLLM server started on the same checkpoint.

Prompts are ``--input-len`` random token ids (the same per level in all three), ``--output-len`` tokens
each. The table shows TTFT and ITL medians offline and online, the server's added TTFT (online - offline)
and its ITL ratio, output throughput beside vLLM's, and how the server's own histograms split its time to first
token (means over the level: the engine's queue, the prefill steps, and the hand-off between the front end and
the engine core, which reads new requests between two steps). The figures are written as JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from moeserve.args import add_config_args, config_from_args
from moeserve.bench import online
from moeserve.deps import SERVER_MODULES, require


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    g = p.add_argument_group("serving overhead")
    g.add_argument("--input-len", type=int, default=512, help="prompt tokens per request")
    g.add_argument("--output-len", type=int, default=128, help="generated tokens per request (ignore_eos)")
    g.add_argument("--max-concurrency", type=int, nargs="+", default=[1, 8, 32], metavar="C")
    g.add_argument("--num-prompts", type=int, default=None, help="timed requests per level (default 4 x C, >= 8)")
    g.add_argument("--num-warmups", type=int, default=None, help="untimed requests per level (default C)")
    g.add_argument("--prompt-seed", dest="prompt_seed", type=int, default=0, help="seed of the random prompts")
    g.add_argument("--vllm-url", default=None, help="also load this vLLM server (same checkpoint), e.g. "
                   "http://127.0.0.1:8100 (default: moeserve only)")
    g.add_argument("--vllm-model", default=None, help="model name the vLLM server serves (default: its first)")
    g.add_argument("--server-timeout", type=float, default=1800.0, help="seconds to wait for moeserve serve")
    g.add_argument("--out", default="bench-results", help="directory for the result file")


# --- offline ---------------------------------------------------------------------------------------

def _offline_run(engine, prompts: list[list[int]], concurrency: int, output_len: int) -> tuple[list, float]:
    from moeserve.engine.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    pending = list(prompts)
    active: dict[str, list] = {}  # request id -> [result, added at, last token at, tokens seen]
    results = []
    start = time.perf_counter()
    while pending or active:
        while pending and len(active) < concurrency:
            ids = pending.pop(0)
            seq = engine.add_request(ids, params)
            active[seq.request_id] = [online.RequestResult(prompt_len=len(ids)), time.perf_counter(), 0.0, 0]
        for seq in engine.step():
            now = time.perf_counter()
            entry = active.get(seq.request_id)
            if entry is None:
                continue
            res, added, last, seen = entry
            if len(seq.output_token_ids) > seen:
                if seen == 0:
                    res.ttft = now - added
                else:
                    res.itl.append(now - last)
                entry[2], entry[3] = now, len(seq.output_token_ids)
            if seq.is_finished:
                res.latency, res.output_tokens, res.success = now - added, len(seq.output_token_ids), True
                results.append(res)
                del active[seq.request_id]
    return results, time.perf_counter() - start


def run_offline(config, args, levels: dict[int, tuple[list, list]]) -> list[dict]:
    from moeserve.bench.engine_driver import free_device_memory
    from moeserve.engine.engine import LLMEngine
    engine = LLMEngine(config)
    rows = []
    try:
        for c, (prompts, warm) in levels.items():
            if warm:
                _offline_run(engine, warm, c, args.output_len)
            results, duration = _offline_run(engine, prompts, c, args.output_len)
            rows.append({"concurrency": c} | online.summarize(results, duration))
            _say(f"offline c={c}: TTFT median {rows[-1]['ttft_median_ms']:.2f} ms, "
                 f"ITL median {rows[-1]['itl_median_ms']:.2f} ms")
    finally:
        device = engine.runner.device
        del engine
        free_device_memory(device)
    return rows


# --- online ----------------------------------------------------------------------------------------

class ServerStartError(RuntimeError):
    """``moeserve serve`` exited, or was not ready in time, before the online runs (its own output says why)."""


def start_server(config, timeout: float) -> tuple[subprocess.Popen, str, Path]:
    """``moeserve serve`` on ``config`` (port chosen by the server) in a child process; returns it and its URL."""
    import yaml
    tmp = Path(tempfile.mkdtemp(prefix="moeserve-serving-bench-"))
    data = config.model_dump(mode="json", exclude_none=True)
    data["server"] = data.get("server", {}) | {"port": 0, "host": "127.0.0.1", "max_queue_len": 4096}
    (tmp / "config.yaml").write_text(yaml.safe_dump(data))
    proc = subprocess.Popen([sys.executable, "-m", "moeserve.cli", "serve", "--config", str(tmp / "config.yaml")],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: queue.Queue = queue.Queue()

    def read():  # for the server's whole life, so a full pipe never blocks it
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)
    threading.Thread(target=read, name="moeserve-serve-stdout", daemon=True).start()
    deadline = time.monotonic() + timeout
    ended = False
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            ended = True  # its output closed: it is exiting
            break
        m = re.search(r"serving .* at (http://\S+)/v1", line)
        if m:
            return proc, m.group(1), tmp
    try:
        code = proc.wait(10.0) if ended else None
    except subprocess.TimeoutExpired:
        code = None
    if code is None:
        proc.kill()
        proc.wait()
        raise ServerStartError(f"moeserve serve was not ready after {timeout:.0f} s (--server-timeout)")
    raise ServerStartError(f"moeserve serve exited with code {code} before it was ready (its output above says why)")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()


async def _online_levels(args, url: str, model: str | None, backend: str, levels) -> list[dict]:
    httpx = require("httpx", "moeserve bench serving")
    ns = argparse.Namespace(output_len=args.output_len, temperature=0.0, input_len=args.input_len,
                            num_prompts=None, num_warmups=None, seed=args.prompt_seed, request_rate=float("inf"),
                            burstiness=1.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    rows = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        models = await online._wait_ready(client, url, {}, 600.0)
        model = model or models["data"][0]["id"]
        for c, (prompts, warm) in levels.items():
            rows.append(await _online_level(client, ns, url, model, c, prompts, warm))
            _say(f"{backend} c={c}: TTFT median {rows[-1]['ttft_median_ms'] or 0:.2f} ms, "
                 f"ITL median {rows[-1]['itl_median_ms'] or 0:.2f} ms, {rows[-1]['failed']} failed")
    return rows


async def _online_level(client, ns, url: str, model: str, c: int, prompts, warm) -> dict:
    def payload(ids):
        return {"model": model, "prompt": ids, "max_tokens": ns.output_len, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
    sem = asyncio.Semaphore(c)

    async def one(ids):
        async with sem:
            return await online._one_request(client, url + "/v1/completions", payload(ids), {})
    if warm:
        await asyncio.gather(*(one(ids) for ids in warm))
    before = await _server_metrics(client, url)
    start = time.perf_counter()
    results = await asyncio.gather(*(one(ids) for ids in prompts))
    row = {"concurrency": c} | online.summarize(results, time.perf_counter() - start)
    row["errors"] = sorted({r.error for r in results if r.error})[:3]
    return row | _ttft_split(before, await _server_metrics(client, url))


TTFT_SPLIT = {"queue_ms": "moeserve_request_queue_time_seconds", "prefill_ms": "moeserve_request_prefill_time_seconds",
              "handoff_ms": "moeserve_request_handoff_time_seconds"}


async def _server_metrics(client, url: str) -> dict[str, float]:
    """The server's /metrics page, parsed (empty when it has none)."""
    from moeserve.server.metrics import parse_metrics
    try:
        resp = await client.get(url + "/metrics")
    except Exception:  # noqa: BLE001 - a server without the page: no split
        return {}
    return parse_metrics(resp.text) if resp.status_code == 200 else {}


def _ttft_split(before: dict, after: dict) -> dict:
    """The mean of each part of the time to first token over the level's requests, from moeserve's histograms
    (engine queue, prefill steps, hand-off between the front end and the engine core); {} for other servers."""
    out = {}
    for key, name in TTFT_SPLIT.items():
        n = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
        if n > 0:
            out[key] = 1e3 * (after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)) / n
    return out


# --- the run ---------------------------------------------------------------------------------------

def _say(msg: str) -> None:
    print(f"bench serving: {msg}", file=sys.stderr, flush=True)


def _levels(args, vocab: int) -> dict[int, tuple[list, list]]:
    token_range = min(online.DEFAULT_TOKEN_RANGE, vocab)
    out = {}
    for c in args.max_concurrency:
        num = args.num_prompts or max(8, 4 * c)
        warm = c if args.num_warmups is None else args.num_warmups
        out[c] = (online.make_prompts(num, args.input_len, token_range, [args.prompt_seed, c]),
                  online.make_prompts(warm, args.input_len, token_range, [args.prompt_seed, c, 1]) if warm else [])
    return out


def compare(offline: list[dict], served: list[dict], vllm: list[dict] | None) -> list[dict]:
    rows = []
    for i, off in enumerate(offline):
        on = served[i]
        row = {"concurrency": off["concurrency"],
               "offline_ttft_ms": off["ttft_median_ms"], "online_ttft_ms": on["ttft_median_ms"],
               "offline_itl_ms": off["itl_median_ms"], "online_itl_ms": on["itl_median_ms"],
               "offline_tok_s": off["output_tok_s"], "online_tok_s": on["output_tok_s"]}
        if None not in (on["ttft_median_ms"], off["ttft_median_ms"]):
            row["added_ttft_ms"] = on["ttft_median_ms"] - off["ttft_median_ms"]
        if on["itl_median_ms"] and off["itl_median_ms"]:
            row["itl_ratio"] = on["itl_median_ms"] / off["itl_median_ms"]
        row |= {k: on[k] for k in TTFT_SPLIT if k in on}  # means, as the server's histograms split its TTFT
        if vllm:
            v = vllm[i]
            row |= {"vllm_ttft_ms": v["ttft_median_ms"], "vllm_itl_ms": v["itl_median_ms"],
                    "vllm_tok_s": v["output_tok_s"]}
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    cols = [("concurrency", "c", "d"), ("offline_ttft_ms", "TTFT off", ".2f"), ("online_ttft_ms", "TTFT on", ".2f"),
            ("added_ttft_ms", "+TTFT", ".2f"), ("offline_itl_ms", "ITL off", ".3f"), ("online_itl_ms", "ITL on", ".3f"),
            ("itl_ratio", "ITL on/off", ".3f"), ("online_tok_s", "tok/s on", ".1f"),
            ("queue_ms", "queue mean", ".2f"), ("prefill_ms", "prefill mean", ".2f"),
            ("handoff_ms", "handoff mean", ".2f"),
            ("vllm_ttft_ms", "vLLM TTFT", ".2f"), ("vllm_itl_ms", "vLLM ITL", ".3f"), ("vllm_tok_s", "vLLM tok/s", ".1f")]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    print("  ".join(f"{h:>11}" for _, h, _ in cols))
    for r in rows:
        print("  ".join(f"{r[k]:>11{f}}" if r.get(k) is not None else f"{'-':>11}" for k, _, f in cols))


def run(args: argparse.Namespace) -> int:
    import logging
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from moeserve.config import resolve_model_source
    from moeserve.models import arch_from_hf
    config = config_from_args(args)
    for module in SERVER_MODULES:  # before the offline runs, not after them
        require(module, "moeserve bench serving (it starts moeserve serve)")
    vocab = arch_from_hf(resolve_model_source(config.model, config.weights_dir).config).vocab_size
    levels = _levels(args, vocab)
    offline = run_offline(config, args, levels)
    proc, url, tmp = start_server(config, args.server_timeout)
    try:
        served = asyncio.run(_online_levels(args, url, None, "moeserve", levels))
    finally:
        stop_server(proc)
    vllm = asyncio.run(_online_levels(args, args.vllm_url.rstrip("/"), args.vllm_model, "vllm", levels)) \
        if args.vllm_url else None
    rows = compare(offline, served, vllm)
    print_table(rows)
    result = {"kind": "serving-overhead", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["moeserve", *sys.argv[1:]]), "config": config.model_dump(mode="json"),
              "input_len": args.input_len, "output_len": args.output_len, "comparison": rows,
              "offline": offline, "online": served, "vllm": vllm, "vllm_url": args.vllm_url}
    os.makedirs(args.out, exist_ok=True)
    path = Path(args.out) / f"serving-overhead-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    failed = sum(r["failed"] for r in served + (vllm or []))
    return 0 if failed == 0 else 1
