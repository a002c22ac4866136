"""Prometheus metrics for `GET /metrics`, under vLLM's names where vLLM has one
(its NIXL connector's `vllm:nixl_*` for transfers), so dashboards and scrapers written
for `vllm serve` work unchanged; the metrics vLLM lacks (GDN state slots, bytes in
use, compiles while serving, device busy time, the decode side's prefix-cache skips)
are `qwen35:*`.

Two sources:
  * latencies and token counts are observed here, per request, as the server
    sees them (arrival of the HTTP request to each token it receives), which is
    what a client measures and does not depend on the backend; the one part only
    the engine knows, the time a request waited before its first step (its prefill
    worker's, when disaggregated), comes with its first output (`queue_s`), and
    the prefill time is the time to first token less it;
  * pool and queue levels, compiles, tokens per step and prefill -> decode transfers
    are read from `backend.stats()` at scrape time (summed over the workers by the
    router; transfer figures are zero for the aggregated engine, which moves no state).
Each app has its own registry, so several servers can live in one process.
"""

import time
from collections.abc import Callable

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from serving.bucket_counts import cumulative
from serving.engine import RequestOutput

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


def _one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Metrics:
    def __init__(self, model_name: str, stats: Callable[[], dict], max_model_len: int = 1 << 20):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def seconds(name, doc, buckets=_E2E_BUCKETS):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.queue_time = seconds("vllm:request_queue_time_seconds",
                                  "Time a request waited before its first step")
        self.prefill_time = seconds("vllm:request_prefill_time_seconds",
                                    "Time from a request's first step to its first token")
        self.decode_time = seconds("vllm:request_decode_time_seconds",
                                   "Time from a request's first token to its last")
        self.tpot = seconds("vllm:time_per_output_token_seconds",
                            "Mean time per output token after the first, per request",
                            _ITL_BUCKETS)
        tokens = _one_two_five(max_model_len)
        self.prompt_hist = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request",
                                     labels, buckets=tokens, registry=r).labels(model_name)
        self.generation_hist = Histogram("vllm:request_generation_tokens",
                                         "Generated tokens per request", labels, buckets=tokens,
                                         registry=r).labels(model_name)
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
        return RequestTimer(self, num_prompt_tokens, start)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    def __init__(self, metrics: Metrics, num_prompt_tokens: int, start: float):
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.start = self.last = start
        self.first: float | None = None  # when the first token arrived
        self.queue: float | None = None  # the engine's queue time, from the first output
        self.num_tokens = 0

    def output(self, out: RequestOutput) -> None:
        """One output of the request reached the server."""
        if self.queue is None and "queue_s" in out.metrics:
            self.queue = out.metrics["queue_s"]
        self.tokens(len(out.new_token_ids))
        if out.finished:
            self.finish(out.finish_reason)

    def tokens(self, n: int) -> None:
        """`n` new tokens reached the server."""
        if n <= 0:
            return
        now = time.perf_counter()
        m = self.metrics
        if self.num_tokens == 0:
            m.ttft.observe(now - self.start)
            self.first = now
        else:
            for _ in range(n):
                m.itl.observe((now - self.last) / n)
        self.num_tokens += n
        self.last = now
        m.generation_tokens.inc(n)

    def finish(self, reason: str | None) -> None:
        m = self.metrics
        m.e2e.observe(time.perf_counter() - self.start)
        m.success.labels(m.model_name, reason or "abort").inc()
        m.prompt_hist.observe(self.num_prompt_tokens)
        m.generation_hist.observe(self.num_tokens)
        if self.first is None:
            return
        queue = self.queue or 0.0
        if self.queue is not None:
            m.queue_time.observe(queue)
        m.prefill_time.observe(max(0.0, self.first - self.start - queue))
        m.decode_time.observe(self.last - self.first)
        if self.num_tokens > 1:
            m.tpot.observe((self.last - self.first) / (self.num_tokens - 1))


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

        def histogram(name, doc, state):
            h = HistogramMetricFamily(name, doc, labels=["model_name"])
            if state is not None:
                h.add_metric([self.model_name], cumulative(state), state["sum"])
            return h

        yield gauge("vllm:num_requests_running", "Requests in the running batch",
                    s["num_running"])
        yield gauge("vllm:num_requests_waiting", "Requests queued, not yet running",
                    s["num_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "Share of KV blocks in use (1 = full)",
                    s["kv_cache_usage"])
        yield gauge("qwen35:state_slot_usage_perc", "Share of GDN state slots in use (1 = full)",
                    s["state_slot_usage"])
        yield gauge("qwen35:kv_cache_bytes_in_use", "Bytes of the KV blocks in use (summed over "
                    "workers)", s.get("kv_bytes_in_use", 0))
        yield gauge("qwen35:state_bytes_in_use", "Bytes of the GDN state slots in use (summed "
                    "over workers)", s.get("state_bytes_in_use", 0))
        yield counter("vllm:num_preemptions", "Preempted requests", s["num_preemptions"])
        yield counter("qwen35:compiles_during_serving", "XLA compilations inside serving steps "
                      "(should stay 0: a shape escaped the start-up buckets)",
                      s["serving_compiles"])
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache", s.get("prefix_cache_queries", 0))
        yield counter("vllm:prefix_cache_hits", "Of vllm:prefix_cache_queries_total, tokens "
                      "found cached (KV blocks and a GDN state snapshot)",
                      s.get("prefix_cache_hits", 0))
        if s.get("spec_decode_num_accepted_tokens_per_pos"):  # speculative decoding on
            yield counter("vllm:spec_decode_num_drafts", "Verified runs of drafts (one per "
                          "request and verify step)", s["spec_decode_num_drafts"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens verified",
                          s["spec_decode_num_draft_tokens"])
            yield counter("vllm:spec_decode_num_accepted_tokens", "Of "
                          "vllm:spec_decode_num_draft_tokens_total, tokens accepted",
                          s["spec_decode_num_accepted_tokens"])
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted drafts by position in the run",
                                          labels=["model_name", "position"])
            for i, v in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
                per_pos.add_metric([self.model_name, str(i)], v)
            yield per_pos
        yield histogram("vllm:iteration_tokens_total", "Tokens per engine step",
                        s.get("iteration_tokens"))
        yield histogram("vllm:nixl_xfer_time_seconds", "Duration of each prefill -> decode "
                        "transfer of a request's KV blocks and GDN state (from the claim to "
                        "the source's ack)", s.get("transfer_time"))
        yield histogram("vllm:nixl_bytes_transferred", "Bytes per transfer",
                        s.get("transfer_size"))
        yield histogram("vllm:nixl_num_descriptors", "NIXL descriptors per transfer",
                        s.get("transfer_descs"))
        yield counter("vllm:nixl_num_failed_transfers", "Transfers that failed or timed out",
                      s.get("transfer_failures", 0))
        yield counter("vllm:nixl_num_kv_expired_reqs", "Prefill results whose lease expired "
                      "unpulled (their blocks went back to the prefill worker)",
                      s.get("leases_expired", 0))
        yield counter("qwen35:kv_transfer_ack_seconds", "Of vllm:nixl_xfer_time_seconds, the "
                      "time from a READ's landing to the source's ack, which holds the "
                      "request's first outputs", s.get("transfer_ack_seconds", 0.0))
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
            ("qwen35:device_busy_seconds", "device_busy_s", "Time the device spent on steps"),
            ("qwen35:device_idle_seconds", "device_idle_s",
             "Time the device waited between steps (host late, or nothing to run)"),
            ("qwen35:device_steps", "device_steps", "Completed engine steps")):
        c = CounterMetricFamily(name, doc, labels=["model_name", "role"])
        for role, v in roles.items():
            c.add_metric([model_name, role], v.get(key, 0))
        yield c
