"""Prometheus metrics of one app, in its own CollectorRegistry (never the process-global one).

Names follow vLLM's with our own prefix (`vllm:time_to_first_token_seconds` is
`orca_jax:time_to_first_token_seconds`), times in seconds, every series labelled with `model_name`,
so a dashboard built for vLLM needs only the prefix changed. Engine-wide numbers (running and
waiting requests, KV pages, token totals) are read from the latest EngineStats at scrape time;
latencies are observed per request on the event loop; iteration time and batch size by the engine
thread after each iteration (prometheus_client is thread-safe).

With several API server processes (`serve --api-server-count N`) whichever one a scrape reaches answers
for the server: the same series and totals as one process would give. Engine-wide numbers come from
the cores, which report to every API server; each process's latencies and counts are kept in
prometheus_client's multiprocess mode (a file per process, summed at the scrape), the token-gap
histogram and the in-flight count in rows of arrays they all map (SharedMetrics); iterations are
observed by API server 0 alone, since every one hears of every iteration.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import itertools
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from orca_jax.engine import EngineStats
from orca_jax.outputs import RequestOutput

PREFIX = "orca_jax:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# The token-gap histogram's numbers: a count per bucket (and +Inf), then the sum of the gaps.
TOKEN_GAP_CELLS = len(_LATENCY_BUCKETS) + 2
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it once, when it is imported


@dataclasses.dataclass(frozen=True, slots=True)
class SharedMetrics:
    """One API server's part in the metrics of a server of several (server/api_servers.py)."""

    index: int  # this API server's row
    multiprocess_dir: str  # prometheus_client's multiprocess directory (MULTIPROC_DIR_ENV, set before import)
    token_gaps: np.ndarray  # f64[api servers, TOKEN_GAP_CELLS]
    in_flight: np.ndarray  # i64[api servers, replicas]: requests each has in flight on each replica


def kv_cache_usage(stats: EngineStats) -> float:
    """Fraction of the pool's usable pages (scratch page excluded) holding or reserved for tokens:
    kv_pages_reserved counts the pages held too (held plus promised), so it alone is the numerator."""
    if not stats.kv_pages_total:
        return 0.0
    return stats.kv_pages_reserved / stats.kv_pages_total


class _EngineStatsCollector(Collector):
    """Exports the engine's own counters as of its latest iteration; for data-parallel replicas, each
    replica's too.

    With replicas every series of an engine metric carries a `replica` label: "0", "1", ... for each,
    and "all" for the server as one (counts summed; kv_cache_usage_perc is the pooled fraction, not a
    sum). Not an unlabelled total beside labelled series: Prometheus' client libraries require one set
    of label names per metric, and a selector must be able to pick the total (`replica="all"`) or the
    replicas (`replica!="all"`); a bare `sum()` over the metric would count everything twice either
    way. A single engine has no replica label at all, so its series are what they always were.
    """

    def __init__(self, latest_stats: Callable[[], EngineStats], num_in_flight: Callable[[], int],
                 model_name: str, replica_stats: Callable[[], Sequence[EngineStats]] | None = None):
        self._latest_stats = latest_stats
        self._num_in_flight = num_in_flight
        self._model_name = model_name
        self._replica_stats = replica_stats

    def collect(self) -> Iterator[Metric]:
        # Each replica read once, and the total made from those reads: in every scrape it is their sum.
        each = list(self._replica_stats()) if self._replica_stats is not None else []
        series = ([((self._model_name, "all"), EngineStats.summed(each))]
                  + [((self._model_name, str(r)), stats) for r, stats in enumerate(each)]
                  if each else [((self._model_name,), self._latest_stats())])
        labels = ("model_name", "replica") if each else ("model_name",)
        for kind, name, documentation, value in _ENGINE_SERIES:
            if value is None:  # the front end's count, no engine's: one series, whatever the replicas
                family = kind(PREFIX + name, documentation, labels=("model_name",))
                family.add_metric((self._model_name,), self._num_in_flight())
            else:
                family = kind(PREFIX + name, documentation, labels=labels)
                for label_values, stats in series:
                    family.add_metric(label_values, value(stats))
            yield family


# (family, name, documentation, its value in one EngineStats): what /metrics reads of an engine.
# None: the server's requests in flight (the front end's count).
_ENGINE_SERIES: tuple[tuple[type, str, str, Callable[[EngineStats], float] | None], ...] = (
    (GaugeMetricFamily, "num_requests_running", "Requests in the running batch", lambda s: s.num_running),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting in the engine's pool", lambda s: s.num_waiting),
    (GaugeMetricFamily, "num_requests_in_flight", "Requests accepted by the server and not yet finished", None),
    (GaugeMetricFamily, "kv_cache_usage_perc", "KV cache usage: 1 means the whole pool is used or reserved "
     "(ORCA reserves a request's max_tokens up front)", kv_cache_usage),
    (GaugeMetricFamily, "kv_cache_used_pages", "KV cache pages holding tokens", lambda s: s.kv_pages_used),
    (GaugeMetricFamily, "kv_cache_reserved_pages", "KV cache pages reserved for tokens still to come",
     lambda s: s.kv_pages_reserved),
    (GaugeMetricFamily, "kv_cache_total_pages", "KV cache pages requests can use (the scratch page excluded)",
     lambda s: s.kv_pages_total),
    (GaugeMetricFamily, "kv_cache_lent_pages", "KV cache pages lent to a fine-tuning job now (their memory is "
     "the job's)", lambda s: s.kv_pages_lent),
    (GaugeMetricFamily, "num_compiled_programs", "Programs compiled (or loaded) so far",
     lambda s: s.num_compiled_programs),
    (CounterMetricFamily, "num_preemptions", "Requests preempted (KV freed, recomputed later) to make room",
     lambda s: s.num_preemptions),
    (CounterMetricFamily, "deadline_hits", "Requests with a deadline that finished by it", lambda s: s.deadline_hits),
    (CounterMetricFamily, "deadline_misses", "Requests with a deadline that finished after it or were dropped",
     lambda s: s.deadline_misses),
    (CounterMetricFamily, "prompt_tokens", "Prompt tokens processed", lambda s: s.prompt_tokens_total),
    (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
     lambda s: s.prefix_cache_queries),
    (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)",
     lambda s: s.prefix_cache_hits),
    (CounterMetricFamily, "generation_tokens", "Tokens generated", lambda s: s.generated_tokens_total),
    (CounterMetricFamily, "iterations", "Engine iterations run", lambda s: s.iterations),
    # The engine's time per iteration, split (summed; over iterations: the means), so a load test over
    # HTTP can set the engine's side beside the same run in process (bench serve does).
    (CounterMetricFamily, "host_seconds", "Seconds the engine's host spent scheduling, building batches and "
     "handling outputs", lambda s: s.host_seconds_total),
    (CounterMetricFamily, "device_wait_seconds", "Seconds the engine waited for the device's tokens",
     lambda s: s.device_wait_seconds_total),
    (CounterMetricFamily, "batched_requests", "Requests in the running batch, summed over iterations (over "
     "iterations: the mean batch)", lambda s: s.batch_size_total),
    (CounterMetricFamily, "fine_tuning_iterations", "Fine-tuning iterations run (one micro-batch's forward and "
     "backward)", lambda s: s.fine_tuning_iterations),
    (CounterMetricFamily, "fine_tuning_tokens", "Tokens fine-tuning iterations ran over (their rate: fine-tuning "
     "tokens/s)", lambda s: s.fine_tuning_tokens_total),
    (CounterMetricFamily, "fine_tuning_seconds", "Seconds fine-tuning iterations took",
     lambda s: s.fine_tuning_seconds_total),
    (CounterMetricFamily, "inference_deferrals", "Fine-tuning iterations run while inference requests waited "
     "(deferred)", lambda s: s.inference_deferrals_total),
    (CounterMetricFamily, "inference_deferral_seconds", "Seconds of those iterations: what waiting requests "
     "were deferred for", lambda s: s.inference_deferral_seconds_total),
    (CounterMetricFamily, "kv_loans", "Times the KV pool lent its top pages to a fine-tuning job",
     lambda s: s.kv_loans_total),
    (CounterMetricFamily, "kv_loan_seconds", "Seconds spent resizing the KV pool for loans and their return",
     lambda s: s.kv_loan_seconds_total),
    (CounterMetricFamily, "fine_tuning_parks", "Times a fine-tuning job gave its borrowed KV pages back to "
     "waiting requests", lambda s: s.fine_tuning_parks_total),
)


class _TokenGapHistogram(Collector):
    """Gaps between one request's tokens, exported under each of `names`; observed on the event loop.

    prometheus_client's Histogram walks its buckets in Python and takes a lock per observation, and
    vLLM's two names for this histogram made that two per token: after the socket write itself, the
    event loop's largest cost per token. Here one output's tokens are one bisect, whatever the names.
    `rows`: every API server's cells (counts, then the sum), this process's at `index`; one row of
    this process's own when None.
    """

    def __init__(self, names: tuple[tuple[str, str], ...], buckets: tuple[float, ...], model_name: str,
                 rows: np.ndarray | None = None, index: int = 0):
        self._names = names  # (name, documentation)
        self._bounds = (*buckets, math.inf)
        assert len(self._bounds) + 1 == TOKEN_GAP_CELLS or rows is None
        self._rows = [memoryview(row) for row in rows] if rows is not None else [
            memoryview(array.array("d", bytes(8 * (len(self._bounds) + 1))))]
        self._cells = self._rows[index]  # counts per bucket, then the sum; written by this process only
        self._sum_cell = len(self._bounds)
        self._model_name = model_name

    def observe(self, seconds: float, count: int = 1) -> None:
        """`count` gaps of `seconds` each."""
        cells = self._cells
        bucket = bisect.bisect_left(self._bounds, seconds)  # le: seconds <= bound
        cells[bucket] += count
        cells[self._sum_cell] += seconds * count

    def collect(self) -> Iterator[Metric]:
        cells = [sum(column) for column in zip(*self._rows)]
        buckets = [(floatToGoString(bound), int(count))
                   for bound, count in zip(self._bounds, itertools.accumulate(cells[:self._sum_cell]))]
        for name, documentation in self._names:
            family = HistogramMetricFamily(PREFIX + name, documentation, labels=("model_name",))
            family.add_metric((self._model_name,), buckets, cells[self._sum_cell])
            yield family


class ServerMetrics:
    """All metrics of one app; `render()` gives the Prometheus text format. `replica_stats`: each
    data-parallel replica's latest stats (None: one engine), exported per replica too. `shared`: this
    process's part in a server of several API server processes (None: the only one)."""

    def __init__(self, latest_stats: Callable[[], EngineStats], num_in_flight: Callable[[], int], *,
                 model_name: str, replica_stats: Callable[[], Sequence[EngineStats]] | None = None,
                 shared: SharedMetrics | None = None):
        # Where this process records; with `shared`, a scrape renders every process's records instead.
        self.registry = CollectorRegistry(auto_describe=True)
        self._rendered = self.registry
        self.observes_iterations = shared is None or shared.index == 0
        if shared is not None:
            if os.environ.get(MULTIPROC_DIR_ENV) != shared.multiprocess_dir:
                raise RuntimeError(f"{MULTIPROC_DIR_ENV} must be {shared.multiprocess_dir} before prometheus_client "
                                   "is imported, in every API server process")
            self._rendered = CollectorRegistry(auto_describe=True)
            MultiProcessCollector(self._rendered, path=shared.multiprocess_dir)
            in_flight = shared.in_flight
            num_in_flight = lambda: int(in_flight.sum())  # noqa: E731 - every API server's
        self.labels = {"model_name": model_name}

        def histogram(name: str, documentation: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, documentation, labelnames=("model_name",), buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "From request arrival to its first generated token",
            _LATENCY_BUCKETS)
        self.token_gaps = _TokenGapHistogram((
            ("inter_token_latency_seconds", "Between consecutive generated tokens of one request"),
            # vLLM's older name for the same observations; dashboards still use it.
            ("time_per_output_token_seconds", "Between consecutive generated tokens of one request "
             "(the same as inter_token_latency_seconds)"),
        ), _LATENCY_BUCKETS, model_name, None if shared is None else shared.token_gaps,
            0 if shared is None else shared.index)
        self._rendered.register(self.token_gaps)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "One request's mean time per token after its first",
            _LATENCY_BUCKETS)
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "From request arrival to its last token", _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each request", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated for each finished request", _TOKEN_BUCKETS)
        self.request_max_tokens = histogram(
            "request_params_max_tokens", "max_tokens of each request, after the server's default",
            _TOKEN_BUCKETS)
        self.iteration_time = histogram(
            "iteration_seconds", "Wall time of one engine iteration", _LATENCY_BUCKETS)
        self.batch_size = histogram("batch_size", "Requests per engine iteration", _BATCH_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens fed per engine iteration", _TOKEN_BUCKETS)
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "From request arrival to its first admission into "
            "the running batch, by request priority", labelnames=("model_name", "priority"),
            buckets=_REQUEST_BUCKETS, registry=self.registry)
        self.requests_finished = Counter(
            PREFIX + "request_success", "Requests that ended, by finish reason (abort: the client "
            "left or the server shut down)", labelnames=("finished_reason", "model_name"),
            registry=self.registry)
        self.requests_rejected = Counter(
            PREFIX + "requests_rejected", "Requests the engine refused (pool full, not running, too big), "
            "by HTTP status", labelnames=("status", "model_name"), registry=self.registry)
        self._rendered.register(_EngineStatsCollector(latest_stats, num_in_flight, model_name, replica_stats))

    def add_collector(self, collector: Collector) -> None:
        """Export `collector`'s metrics too (read at each scrape)."""
        self._rendered.register(collector)

    def observe_iteration(self, stats: EngineStats) -> None:
        """Called on the engine thread after every iteration."""
        if not self.observes_iterations:
            return
        self.iteration_time.observe(stats.last_iteration_seconds)
        self.batch_size.observe(stats.last_batch_size)
        self.iteration_tokens.observe(stats.last_num_tokens)

    def request_timer(self, num_prompt_tokens: int, max_tokens: int, priority: int = 0) -> RequestTimer:
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_max_tokens.observe(max_tokens)
        return RequestTimer(self, priority)

    def render(self) -> bytes:
        return generate_latest(self._rendered)


class RequestTimer:
    """Latencies of one engine request, fed with its outputs as they reach the handler."""

    def __init__(self, metrics: ServerMetrics, priority: int = 0):
        self._metrics = metrics
        self._priority = str(priority)
        self._queue_time_seen = False
        self._arrival = time.monotonic()
        self._first_token_time: float | None = None
        self._last_token_time: float | None = None
        self._num_tokens = 0
        self.finished = False

    def on_output(self, output: RequestOutput) -> None:
        self.on_outputs((output,))

    def on_outputs(self, outputs: Sequence[RequestOutput]) -> None:
        """Outputs that reached the handler together (one wake-up): one clock read for all; the tokens
        after the first of them came with no gap, counted in one observation."""
        now = time.monotonic()
        metrics = self._metrics
        zero_gaps = 0
        for output in outputs:
            if output.queue_seconds is not None and not self._queue_time_seen:
                self._queue_time_seen = True
                metrics.request_queue_time.labels(model_name=metrics.labels["model_name"],
                                                  priority=self._priority).observe(output.queue_seconds)
            count = len(output.new_token_ids)
            if count:
                if self._last_token_time is None:
                    metrics.time_to_first_token.observe(now - self._arrival)
                    self._first_token_time = now
                elif self._last_token_time == now:
                    zero_gaps += count
                else:
                    metrics.token_gaps.observe((now - self._last_token_time) / count, count)
                self._num_tokens += count
                self._last_token_time = now
            if output.finished and not self.finished:
                self._finish(output.finish_reason or "unknown", now)
        if zero_gaps:
            metrics.token_gaps.observe(0.0, zero_gaps)

    def on_abort(self) -> None:
        """The request ended without a final output (its client left): count it as aborted."""
        if not self.finished:
            self._finish("abort", time.monotonic())

    def _finish(self, reason: str, now: float) -> None:
        self.finished = True
        metrics = self._metrics
        metrics.e2e_latency.observe(now - self._arrival)
        metrics.request_generation_tokens.observe(self._num_tokens)
        if self._num_tokens > 1 and self._first_token_time is not None:
            metrics.request_time_per_output_token.observe(
                (self._last_token_time - self._first_token_time) / (self._num_tokens - 1))
        metrics.requests_finished.labels(finished_reason=reason, **metrics.labels).inc()
