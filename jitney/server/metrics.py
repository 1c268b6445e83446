"""Prometheus metrics named as vLLM names them (``jitney:`` instead of ``vllm:``), so dashboards
built for vLLM read jitney unchanged.

Each server owns its own ``CollectorRegistry``: no process-global state, so several servers (or
tests) in one process never see each other's numbers. Engine-wide values (queue lengths, KV
usage, preemptions, prefix-cache counters) are read at scrape time from the latest snapshot the
engine thread published; per-request values are observed when a request finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "jitney:"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state as of the end of the last step; written by the engine thread, read anywhere."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens
    num_free_blocks: int = 0


@dataclass(frozen=True)
class FinishedRequestTimes:
    """Per-request latencies in seconds (None when the request never got that far)."""

    queue_time: float | None
    ttft: float | None
    inter_token_latencies: tuple[float, ...]
    e2e: float
    num_prompt_tokens: int
    num_output_tokens: int


class _EngineCollector(Collector):
    """Turns the current ``EngineSnapshot`` into gauges and counters at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self._snapshot = snapshot
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        gauges = (
            ("num_requests_running", "Number of requests in the running batch.", snap.num_running),
            ("num_requests_waiting", "Number of requests waiting to be scheduled.", snap.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", snap.kv_cache_usage),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(self._labels, float(value))
            yield family
        counters = (
            ("num_preemptions", "Cumulative number of preemptions.", snap.num_preemptions),
            ("prefix_cache_queries", "Prefix-cache queries, in tokens.", snap.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix-cache hits, in tokens.", snap.prefix_cache_hits),
        )
        for name, doc, value in counters:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(self._labels, float(value))
            yield family


class ServerMetrics:
    """All collectors of one server, in one registry of its own."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens.", labels, registry=reg)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generation tokens produced.", labels, registry=reg
        )
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", [*labels, "finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token.", labels,
            buckets=_LATENCY_BUCKETS, registry=reg,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between consecutive output tokens.", labels,
            buckets=_LATENCY_BUCKETS, registry=reg,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "End-to-end request latency.", labels,
            buckets=_REQUEST_BUCKETS, registry=reg,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "Time from arrival to first scheduling.", labels,
            buckets=_REQUEST_BUCKETS, registry=reg,
        )
        reg.register(_EngineCollector(snapshot, model_name))
        # Children exist from the start, so every series reads 0 before the first request.
        per_model = (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                     self.queue_time)
        for metric in per_model:
            metric.labels(model_name)

    def observe_finished(self, times: FinishedRequestTimes, finish_reason: str) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(times.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(times.num_output_tokens)
        self.request_success.labels(m, finish_reason).inc()
        self.e2e.labels(m).observe(times.e2e)
        if times.queue_time is not None:
            self.queue_time.labels(m).observe(times.queue_time)
        if times.ttft is not None:
            self.ttft.labels(m).observe(times.ttft)
        itl = self.itl.labels(m)
        for gap in times.inter_token_latencies:
            itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
