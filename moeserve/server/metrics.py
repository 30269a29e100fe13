"""Prometheus metrics of one server, in its own registry (so several servers can share a process).

Names follow vLLM's where there is one (``vllm:time_to_first_token_seconds`` becomes
``moeserve_time_to_first_token_seconds``), and the same figures are also exported under vLLM's own names
(``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``, ``vllm:num_requests_running``,
...), so dashboards made for vLLM work unchanged. The front end records requests and tokens as their
outputs arrive; the gauges follow the engine core's load reports.
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
        self.queue = Histogram("moeserve_request_queue_time_seconds", "From the engine taking a request to its "
                               "first step (waiting for pages or room in the batch)", labels,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("moeserve_request_prefill_time_seconds", "From a request's first step to its "
                                 "first token (its prompt's steps)", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.handoff = Histogram("moeserve_request_handoff_time_seconds", "The rest of the time to first token: "
                                 "from the front end handing a request to the engine core until the core takes it "
                                 "(between two steps), and its first token's way back", labels,
                                 buckets=LATENCY_BUCKETS, registry=r)
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
        self.cache_queries = Counter("moeserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                     labels, registry=r)
        self.cache_hits = Counter("moeserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", labels,
                                  registry=r)
        self._cache_seen = (0, 0)
        self.model_name = model_name
        for outcome in OUTCOMES:
            self.requests.labels(model_name, outcome)
        self._m = {name: getattr(self, name).labels(model_name) for name in (
            "prompt_tokens", "generation_tokens", "ttft", "queue", "prefill", "handoff", "itl", "e2e", "running",
            "waiting", "pages_used", "pages_total", "preemptions", "cache_queries", "cache_hits")}
        self.vllm = VllmMetrics(r, model_name)
        for name, twin in self.vllm.twins().items():
            self._m[name] = _Both(self._m[name], *twin)

    def __getitem__(self, name: str):
        return self._m[name]

    def request_done(self, outcome: str) -> None:
        self.requests.labels(self.model_name, outcome).inc()
        if outcome != "error":
            self.vllm.success.labels(self.model_name, outcome).inc()

    def request_rejected(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def set_load(self, running: int, waiting: int, pages_used: int, pages_total: int, preemptions: int,
                 cache_queries: int = 0, cache_hits: int = 0) -> None:
        """The engine's load; ``cache_*`` are the engine's running totals (the counters move by the change)."""
        m = self._m
        q0, h0 = self._cache_seen
        if cache_queries >= q0 and cache_hits >= h0:
            m["cache_queries"].inc(cache_queries - q0)
            m["cache_hits"].inc(cache_hits - h0)
            self._cache_seen = (cache_queries, cache_hits)
        m["running"].set(running)
        m["waiting"].set(waiting)
        m["pages_used"].set(pages_used)
        m["pages_total"].set(pages_total)
        m["preemptions"].set(preemptions)
        self.vllm.kv_usage.set(pages_used / pages_total if pages_total else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Both:
    """One figure recorded under two names."""

    def __init__(self, *children):
        self.children = children

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)

    def inc(self, value: float = 1) -> None:
        for c in self.children:
            c.inc(value)

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)


class VllmMetrics:
    """The same figures under vLLM's metric names (vLLM 0.26), for dashboards built for vLLM."""

    def __init__(self, r: CollectorRegistry, model_name: str):
        labels = ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                              "seconds (the inter-token latency, vLLM's older name).", labels, buckets=ITL_BUCKETS,
                              registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               labels + ["finished_reason"], registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels,
                              registry=r).labels(model_name)
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                     "queried tokens.", labels, registry=r)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                  "tokens.", labels, registry=r)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)

    def twins(self) -> dict[str, tuple]:
        """moeserve figure -> its vLLM-named children."""
        n = self.model_name
        return {"ttft": (self.ttft.labels(n),), "itl": (self.itl.labels(n), self.tpot.labels(n)),
                "e2e": (self.e2e.labels(n),), "running": (self.running.labels(n),),
                "waiting": (self.waiting.labels(n),), "prompt_tokens": (self.prompt_tokens.labels(n),),
                "generation_tokens": (self.generation_tokens.labels(n),),
                "cache_queries": (self.cache_queries.labels(n),), "cache_hits": (self.cache_hits.labels(n),)}


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
