"""Prometheus metrics of one app, in its own CollectorRegistry (never the process-global one).

Engine-wide numbers (running/waiting requests, KV pages, token totals) are read from the latest
EngineStats at scrape time; latencies are observed per request on the event loop; iteration time
and batch size are observed by the engine thread after each iteration (prometheus_client is
thread-safe).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from orca_jax.outputs import RequestOutput

if TYPE_CHECKING:
    from orca_jax.engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _EngineStatsCollector(Collector):
    """Exports the engine's own counters as of its latest iteration."""

    def __init__(self, latest_stats: Callable[[], EngineStats], num_in_flight: Callable[[], int]):
        self._latest_stats = latest_stats
        self._num_in_flight = num_in_flight

    def collect(self) -> Iterator[Metric]:
        stats = self._latest_stats()
        gauges = (
            ("orca_num_requests_running", "Requests in the running batch", stats.num_running),
            ("orca_num_requests_waiting", "Requests waiting in the engine's pool", stats.num_waiting),
            ("orca_num_requests_in_flight", "Requests accepted by the server and not yet finished",
             self._num_in_flight()),
            ("orca_kv_pages_used", "KV cache pages holding tokens", stats.kv_pages_used),
            ("orca_kv_pages_reserved", "KV cache pages reserved for tokens still to come (ORCA "
             "reserves max_tokens up front)", stats.kv_pages_reserved),
            ("orca_kv_pages_total", "KV cache pages in the pool", stats.kv_pages_total),
            ("orca_num_compiled_buckets", "Step programs compiled so far", stats.num_compiled_buckets),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        counters = (
            ("orca_prompt_tokens", "Prompt tokens processed", stats.prompt_tokens_total),
            ("orca_generation_tokens", "Tokens generated", stats.generated_tokens_total),
            ("orca_iterations", "Engine iterations run", stats.iterations),
        )
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)


class ServerMetrics:
    """All metrics of one app; `render()` gives the Prometheus text format."""

    def __init__(self, latest_stats: Callable[[], EngineStats], num_in_flight: Callable[[], int]):
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.time_to_first_token = Histogram(
            "orca_time_to_first_token_seconds", "From request arrival to its first generated token",
            buckets=_LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram(
            "orca_inter_token_latency_seconds", "Between consecutive generated tokens of one request",
            buckets=_LATENCY_BUCKETS, registry=registry)
        self.e2e_latency = Histogram(
            "orca_e2e_request_latency_seconds", "From request arrival to its last token",
            buckets=_REQUEST_BUCKETS, registry=registry)
        self.iteration_time = Histogram(
            "orca_iteration_seconds", "Wall time of one engine iteration",
            buckets=_LATENCY_BUCKETS, registry=registry)
        self.batch_size = Histogram(
            "orca_batch_size", "Requests per engine iteration", buckets=_BATCH_BUCKETS, registry=registry)
        self.batch_tokens = Histogram(
            "orca_batch_tokens", "Tokens fed per engine iteration", buckets=_TOKEN_BUCKETS,
            registry=registry)
        self.requests_finished = Counter(
            "orca_requests_finished", "Requests that ended, by finish reason",
            labelnames=("finish_reason",), registry=registry)
        self.requests_rejected = Counter(
            "orca_requests_rejected", "Requests the engine refused (pool full, not running, too big), "
            "by HTTP status",
            labelnames=("status",), registry=registry)
        registry.register(_EngineStatsCollector(latest_stats, num_in_flight))

    def observe_iteration(self, stats: EngineStats) -> None:
        """Called on the engine thread after every iteration."""
        self.iteration_time.observe(stats.last_iteration_seconds)
        self.batch_size.observe(stats.last_batch_size)
        self.batch_tokens.observe(stats.last_num_tokens)

    def request_timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latencies of one request, fed with its outputs as they reach the handler."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics
        self._arrival = time.monotonic()
        self._last_token_time: float | None = None

    def on_output(self, output: RequestOutput) -> None:
        now = time.monotonic()
        num_new = len(output.new_token_ids)
        if num_new:
            if self._last_token_time is None:
                self._metrics.time_to_first_token.observe(now - self._arrival)
                num_new -= 1
            elif num_new:
                per_token = (now - self._last_token_time) / num_new
                for _ in range(num_new):
                    self._metrics.inter_token_latency.observe(per_token)
            self._last_token_time = now
        if output.finished:
            self._metrics.e2e_latency.observe(now - self._arrival)
            self._metrics.requests_finished.labels(output.finish_reason or "unknown").inc()
