"""``moeserve bench online``: load an OpenAI-compatible server (moeserve's or ``vllm serve``) the way
``vllm bench serve`` does, and write the result in the shared benchmark schema (kind "online").

Definitions follow vLLM's ``benchmarks/serve.py`` with the random dataset at range ratio 0: every
prompt is ``--input-len`` random token ids sent as a token-id list, ``ignore_eos`` with ``max_tokens =
--output-len``, greedy, streamed with usage in the last chunk. TTFT is the time to the first chunk with
choices; ITL the gaps between chunks; TPOT = (latency - TTFT) / (output tokens - 1); E2EL the latency.
Throughputs divide by the wall time of the timed requests (warm-ups excluded). With ``--request-rate``
requests arrive as a Poisson process (gamma with ``--burstiness``); ``inf`` sends them all at once;
``--max-concurrency`` caps how many are in flight (one row per value).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np

DEFAULT_TOKEN_RANGE = 10000  # like vllm bench latency: ids drawn from [0, 10000) unless the vocabulary is smaller


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--endpoint", default="/v1/completions", help="completions endpoint (token-id prompts)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models id)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request (ignore_eos)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="timed requests per concurrency level (default: 4 x concurrency, at least 8)")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[1, 8, 32], metavar="C",
                   help="requests in flight at most; one row per value")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    p.add_argument("--num-warmups", type=int, default=None,
                   help="untimed requests before each level (default: the concurrency level)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"draw token ids from [0, N) (default: min({DEFAULT_TOKEN_RANGE}, the server's vocab_size))")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default greedy)")
    p.add_argument("--backend-name", choices=["moeserve", "vllm"], default="moeserve",
                   help="which server this is (the engine entry's name)")
    p.add_argument("--label", default=None, help="engine label, to tell runs apart in moeserve compare (default: --backend-name)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the server")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", "--output-dir", dest="out", default="bench-results", help="directory for the result files")


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


async def _one_request(client, url: str, payload: dict, headers: dict) -> RequestResult:
    res = RequestResult(prompt_len=len(payload["prompt"]))
    chunks, usage_tokens = 0, None
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return res
                if obj.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                elif obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
    except Exception as e:  # connection errors, timeouts: count the request as failed
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    res.latency = time.perf_counter() - start
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    res.success = chunks > 0
    if not res.success:
        res.error = "the stream ended without any output"
    return res


def _stats(values: list[float], name: str) -> dict:
    if not values:
        return {f"{name}_mean_ms": None, f"{name}_median_ms": None, f"{name}_p99_ms": None}
    a = np.asarray(values) * 1000.0
    return {f"{name}_mean_ms": float(a.mean()), f"{name}_median_ms": float(np.median(a)),
            f"{name}_p99_ms": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """vLLM's ``calculate_metrics`` for the rows: throughputs and TTFT/TPOT/ITL/E2EL mean, median, p99."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    row = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
           "request_throughput": len(ok) / duration if duration > 0 else None,
           "output_tok_s": total_out / duration if duration > 0 else None,
           "total_tok_s": (total_in + total_out) / duration if duration > 0 else None,
           "total_input_tokens": total_in, "total_output_tokens": total_out}
    row |= _stats([r.ttft for r in ok], "ttft")
    row |= _stats(tpots, "tpot")
    row |= _stats([g for r in ok for g in r.itl], "itl")
    row |= _stats([r.latency for r in ok], "e2el")
    return row


def make_prompts(num: int, input_len: int, token_range: int, seed) -> list[list[int]]:
    """``num`` prompts of ``input_len`` token ids drawn uniformly from [0, token_range)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, token_range, size=(num, input_len)).tolist()


async def _run_level(client, args, url: str, model: str, concurrency: int, token_range: int, headers: dict) -> dict:
    num = args.num_prompts or max(8, 4 * concurrency)
    warmups = concurrency if args.num_warmups is None else args.num_warmups
    # Each level and its warm-ups get prompts of their own, so prefix caching never gives a head start.
    prompts = make_prompts(num, args.input_len, token_range, [args.seed, concurrency])
    warm_prompts = make_prompts(max(warmups, 1), args.input_len, token_range, [args.seed, concurrency, 1])

    def payload(ids):
        return {"model": model, "prompt": ids, "max_tokens": args.output_len, "temperature": args.temperature,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    sem = asyncio.Semaphore(concurrency)
    in_flight = peak = 0

    async def limited(ids):
        nonlocal in_flight, peak
        async with sem:
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await _one_request(client, url, payload(ids), headers)
            finally:
                in_flight -= 1

    if warmups:
        await asyncio.gather(*(limited(ids) for ids in warm_prompts[:warmups]))
        peak = 0
    rng = np.random.default_rng([args.seed, concurrency, 2])
    start = time.perf_counter()
    tasks = []
    for ids in prompts:
        tasks.append(asyncio.create_task(limited(ids)))
        if math.isfinite(args.request_rate) and args.request_rate > 0:
            theta = 1.0 / (args.request_rate * args.burstiness)
            await asyncio.sleep(float(rng.gamma(args.burstiness, theta)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    row = {"workload": "random", "concurrency": concurrency, "prompt_len": args.input_len,
           "output_len": args.output_len, "num_prompts": num,
           "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf"}
    row |= summarize(results, duration)
    errors = sorted({r.error for r in results if r.error})[:5]
    row["max_concurrent_requests"] = peak
    row["runs"] = [{"completed": row["completed"], "failed": row["failed"], "duration_s": duration,
                    "num_warmups": warmups, "errors": errors,
                    "requests": [{"prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
                                  "ttft_ms": r.ttft * 1000, "e2el_ms": r.latency * 1000, "chunks": len(r.itl) + 1,
                                  "error": r.error} for r in results]}]
    return row


async def _wait_ready(client, base: str, headers: dict, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            r = await client.get(f"{base}/v1/models", headers=headers)
            if r.status_code == 200:
                return r.json()
            last = f"HTTP {r.status_code}: {r.text[:200]}"
            if r.status_code in (401, 403):
                break
        except Exception as e:
            last = f"{type(e).__name__}: {e}"
        await asyncio.sleep(1.0)
    raise RuntimeError(f"the server at {base} is not ready: {last}")


async def _get_json(client, url: str, headers: dict) -> dict | None:
    try:
        r = await client.get(url, headers=headers)
        return r.json() if r.status_code == 200 else None
    except Exception:
        return None


async def _bench(args) -> dict:
    from moeserve.deps import require
    httpx = require("httpx", "moeserve bench online")

    base = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        models = await _wait_ready(client, base, headers, args.ready_timeout)
        card = (models.get("data") or [{}])[0]
        model = args.model or card.get("id")
        info = await _get_json(client, f"{base}/server_info", headers) if args.backend_name == "moeserve" else None
        version = await _get_json(client, f"{base}/version", headers) if args.backend_name == "vllm" else None
        vocab = card.get("vocab_size")
        token_range = args.vocab_size or min(DEFAULT_TOKEN_RANGE, vocab or DEFAULT_TOKEN_RANGE)
        rows = []
        for c in args.max_concurrency:
            row = await _run_level(client, args, base + args.endpoint, model, c, token_range, headers)
            rows.append(row)
            print(f"concurrency {c}: {row['completed']} done, {row['failed']} failed, "
                  f"{row['output_tok_s'] or 0:.1f} output tok/s, TTFT median {row['ttft_median_ms'] or 0:.1f} ms",
                  file=sys.stderr, flush=True)
        memory = (await _get_json(client, f"{base}/server_info", headers) or {}).get("memory") if info else None
    return _result(args, model, card, info, version, rows, token_range, memory)


def _result(args, model, card, info, version, rows, token_range, memory) -> dict:
    from moeserve import __version__
    from moeserve.config import EngineConfig
    from moeserve.hardware import probe

    failed = [r for r in rows if r["completed"] == 0]
    engine_info = (info or {}).get("engine", {})
    environment = dict((info or {}).get("hardware") or probe().to_dict())
    environment |= {"server_url": args.url, "endpoint": args.endpoint, "client_host_probe": info is None}
    if version:
        environment["server_version"] = version.get("version")
    config = (info or {}).get("config") or EngineConfig().model_dump(mode="json") | {"model": model}
    label = args.label or args.backend_name
    return {
        "kind": "online", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["moeserve"] + sys.argv[1:]), "moeserve_version": __version__,
        "environment": environment, "config": config,
        "model": {"name": model, "model_type": engine_info.get("model_type"), "dtype": engine_info.get("dtype"),
                  "max_model_len": card.get("max_model_len")},
        "engines": [{"name": args.backend_name, "label": label, "available": not failed,
                     "reason": None if not failed else f"no request completed at concurrency "
                                                       f"{[r['concurrency'] for r in failed]}",
                     "backends": engine_info.get("backends", {}), "start_seconds": engine_info.get("ready_seconds"),
                     "memory": memory, "results": rows}],
        "client": {"request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
                   "burstiness": args.burstiness, "seed": args.seed, "token_id_range": token_range,
                   "temperature": args.temperature, "ignore_eos": True, "range_ratio": 0.0},
    }


def _write(result: dict, out_dir: str, stem: str) -> dict:
    try:
        from moeserve.bench.report import print_result, write_result
    except ImportError:
        print_result = write_result = None
    if write_result is not None:
        print_result(result)
        return write_result(result, out_dir, stem)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    _print_table(result)
    return {"json": path}


def _print_table(result: dict) -> None:
    keys = ["concurrency", "completed", "failed", "request_throughput", "output_tok_s", "total_tok_s",
            "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_median_ms", "tpot_p99_ms",
            "itl_mean_ms", "itl_median_ms", "itl_p99_ms", "e2el_mean_ms", "e2el_median_ms", "e2el_p99_ms"]
    for eng in result["engines"]:
        print(f"{eng['name']} ({eng['label']}), {result['model']['name']}")
        for row in eng["results"]:
            print("  " + ", ".join(f"{k} {row[k]:.2f}" if isinstance(row.get(k), float) else f"{k} {row.get(k)}"
                                   for k in keys))


def run(args: argparse.Namespace) -> int:
    if "chat" in args.endpoint:
        print("bench online: random token-id prompts need a completions endpoint, not chat", file=sys.stderr)
        return 2
    for name in ("input_len", "output_len"):
        if getattr(args, name) < 1:
            print(f"bench online: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if any(c < 1 for c in args.max_concurrency) or (args.num_prompts is not None and args.num_prompts < 1):
        print("bench online: --max-concurrency and --num-prompts must be >= 1", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(_bench(args))
    except RuntimeError as e:
        print(f"bench online: {e}", file=sys.stderr)
        return 1
    name = args.backend_name if args.label in (None, args.backend_name) else f"{args.backend_name}-{args.label}"
    stem = f"online-{name.replace('/', '_')}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    paths = _write(result, args.out, stem)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    rows = result["engines"][0]["results"]
    return 0 if all(r["failed"] == 0 for r in rows) else 1
