"""Prometheus metrics for `GET /metrics`, under vLLM's names where vLLM has one,
so dashboards and scrapers written for `vllm serve` work unchanged; the
metrics vLLM lacks (state slots, transfers, compiles) use the same prefix.

Two sources:
  * latencies and token counts are observed here, per request, as the server
    sees them (arrival of the HTTP request to each streamed token), which is
    what a client measures and does not depend on the backend;
  * pool and queue levels, compiles and prefill -> decode transfers are read
    from `backend.stats()` at scrape time (transfer counters are zero for the
    aggregated engine, which moves no state).
Each app has its own registry, so several servers can live in one process.
"""

import time
from collections.abc import Callable

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# No `*_created` series (process-wide, as in vLLM): they double the output and
# no dashboard reads them.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    def __init__(self, model_name: str, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between streamed tokens",
                             labels, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, end to end",
                             labels, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated",
                                         labels, registry=r).labels(model_name)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason",
                               labels + ["finished_reason"], registry=r)
        self.model_name = model_name
        r.register(_BackendCollector(model_name, stats))

    def request(self, num_prompt_tokens: int, start: float) -> "RequestTimer":
        """Time one accepted engine request from `start` (perf_counter at HTTP arrival)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTimer(self, start)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    def __init__(self, metrics: Metrics, start: float):
        self.metrics = metrics
        self.start = self.last = start
        self.num_tokens = 0

    def tokens(self, n: int) -> None:
        """`n` new tokens reached the server."""
        if n <= 0:
            return
        now = time.perf_counter()
        m = self.metrics
        if self.num_tokens == 0:
            m.ttft.observe(now - self.start)
        else:
            for _ in range(n):
                m.itl.observe((now - self.last) / n)
        self.num_tokens += n
        self.last = now
        m.generation_tokens.inc(n)

    def finish(self, reason: str | None) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)
        self.metrics.success.labels(self.metrics.model_name, reason or "abort").inc()


class _BackendCollector:
    """Gauges read from the backend's counters at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], dict]):
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        s = self.stats()

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch",
                    s["num_running"])
        yield gauge("vllm:num_requests_waiting", "Requests queued, not yet running",
                    s["num_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "Share of KV blocks in use (1 = full)",
                    s["kv_cache_usage"])
        yield gauge("vllm:state_slot_usage_perc", "Share of GDN state slots in use (1 = full)",
                    s["state_slot_usage"])
        yield gauge("vllm:kv_cache_bytes_in_use", "Bytes of the KV blocks in use (summed over "
                    "workers)", s.get("kv_bytes_in_use", 0))
        yield gauge("vllm:state_bytes_in_use", "Bytes of the GDN state slots in use (summed "
                    "over workers)", s.get("state_bytes_in_use", 0))
        yield counter("vllm:num_preemptions", "Preempted requests", s["num_preemptions"])
        yield counter("vllm:compiles_during_serving", "XLA compilations inside serving steps "
                      "(should stay 0: a shape escaped the start-up buckets)",
                      s["serving_compiles"])
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache", s.get("prefix_cache_queries", 0))
        yield counter("vllm:prefix_cache_hits", "Of vllm:prefix_cache_queries_total, tokens "
                      "found cached (KV blocks and a GDN state snapshot)",
                      s.get("prefix_cache_hits", 0))
        yield counter("vllm:kv_transfers", "Prefill -> decode state transfers",
                      s.get("transfers", 0))
        yield counter("vllm:kv_transfer_bytes", "KV and GDN state bytes transferred",
                      s.get("transfer_bytes", 0))
        yield counter("vllm:kv_transfer_seconds", "Time spent in transfers (divided by "
                      "vllm:kv_transfers_total: the mean latency)",
                      s.get("transfer_seconds", 0.0))
        yield counter("vllm:kv_transfer_ack_seconds", "Of vllm:kv_transfer_seconds, the time "
                      "from a READ's landing to the source's ack, which holds the request's "
                      "first outputs", s.get("transfer_ack_seconds", 0.0))
        yield counter("vllm:kv_transfer_descriptors", "NIXL descriptors posted by transfers "
                      "(divided by vllm:kv_transfers_total: descriptors per request)",
                      s.get("transfer_descriptors", 0))
        yield counter("vllm:kv_transfer_failures", "Transfers that failed or timed out",
                      s.get("transfer_failures", 0))
        yield counter("qwen35:kv_transfer_cached_tokens", "Prompt tokens a decode worker did "
                      "not pull: its prefix cache held their KV blocks",
                      s.get("transfer_cached_tokens", 0))
        yield from _device_counters(self.model_name, s)


def _device_counters(model_name: str, s: dict):
    """Device busy / idle seconds and steps per role (``serving.engine.idle_timer``):
    busy over wall time is how much of it the device computed; the rest the host made
    it wait (or there was nothing to run). A router reports each role's sums
    (``s["device"]``), an aggregated server its own engine's."""
    roles = s.get("device") or ({"aggregated": s} if "device_busy_s" in s else {})
    for name, key, doc in (
            ("vllm:device_busy_seconds", "device_busy_s", "Time the device spent on steps"),
            ("vllm:device_idle_seconds", "device_idle_s",
             "Time the device waited between steps (host late, or nothing to run)"),
            ("vllm:device_steps", "device_steps", "Completed engine steps")):
        c = CounterMetricFamily(name, doc, labels=["model_name", "role"])
        for role, v in roles.items():
            c.add_metric([model_name, role], v.get(key, 0))
        yield c
