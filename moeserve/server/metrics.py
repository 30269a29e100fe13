"""Prometheus metrics of one server, in its own registry (so several servers can share a process).

Names follow vLLM's where there is one (``vllm:time_to_first_token_seconds`` becomes
``moeserve_time_to_first_token_seconds``). The engine thread records requests and tokens as they happen;
the gauges are set after every step.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5)
OUTCOMES = ("stop", "length", "abort", "error")


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.requests = Counter("moeserve_requests", "Requests that ended, by outcome (finish reason, "
                                "'abort' for disconnected clients, 'error' for engine failures)",
                                labels + ["outcome"], registry=r)
        self.rejected = Counter("moeserve_requests_rejected", "Requests refused before reaching the engine, "
                                "by HTTP status", labels + ["status"], registry=r)
        self.prompt_tokens = Counter("moeserve_prompt_tokens", "Prompt tokens of accepted requests", labels, registry=r)
        self.generation_tokens = Counter("moeserve_generation_tokens", "Generated tokens", labels, registry=r)
        self.ttft = Histogram("moeserve_time_to_first_token_seconds", "From the request entering the server "
                              "to its first generated token", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("moeserve_inter_token_latency_seconds", "Time between consecutive generated "
                             "tokens of a request", labels, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("moeserve_e2e_request_latency_seconds", "From the request entering the server to "
                             "its last token", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("moeserve_num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("moeserve_num_requests_waiting", "Requests accepted but not yet running "
                             "(including those not yet handed to the engine)", labels, registry=r)
        self.pages_used = Gauge("moeserve_kv_pages_used", "KV cache pages held by requests", labels, registry=r)
        self.pages_total = Gauge("moeserve_kv_pages_total", "KV cache pages requests can use", labels, registry=r)
        self.preemptions = Gauge("moeserve_num_preemptions", "Preemptions since start (a running request's pages "
                                 "taken back and its tokens recomputed later)", labels, registry=r)
        self.model_name = model_name
        for outcome in OUTCOMES:
            self.requests.labels(model_name, outcome)
        self._m = {name: getattr(self, name).labels(model_name) for name in (
            "prompt_tokens", "generation_tokens", "ttft", "itl", "e2e", "running", "waiting", "pages_used",
            "pages_total", "preemptions")}

    def __getitem__(self, name: str):
        return self._m[name]

    def request_done(self, outcome: str) -> None:
        self.requests.labels(self.model_name, outcome).inc()

    def request_rejected(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def set_load(self, running: int, waiting: int, pages_used: int, pages_total: int, preemptions: int) -> None:
        m = self._m
        m["running"].set(running)
        m["waiting"].set(waiting)
        m["pages_used"].set(pages_used)
        m["pages_total"].set(pages_total)
        m["preemptions"].set(preemptions)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """``{"name{label=...}": value}`` and ``{"name": value}`` (summed over labels) from an exposition page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        out[key] = v
        name = key.split("{", 1)[0]
        if "{" in key:
            out[name] = out.get(name, 0.0) + v
    return out
