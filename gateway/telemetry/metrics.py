"""Prometheus metrics (`prometheus_client`), one registry per gateway: requests, latencies and
tokens per model and backend; fallbacks and shadow comparisons; remote backend errors, health and
circuits; the engine's scheduler and KV cache; optionally TGI's own metric names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.telemetry.record import RequestRecord
from gateway.telemetry.tgi_metrics import TgiMetrics

# milliseconds to minutes
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                   3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                         0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class GatewayMetrics:
    def __init__(self, tgi_compatible: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        mb = ["model", "backend"]
        self.requests = Counter("llmgw_requests", "Requests by route, status and finish reason",
                                ["model", "backend", "route", "status", "finish_reason"], registry=r)
        self.in_flight = Gauge("llmgw_requests_in_flight", "Requests being served", ["route"], registry=r)
        self.ttft = Histogram("llmgw_time_to_first_token_seconds", "Time to first token", mb,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("llmgw_inter_token_latency_seconds", "Gap between streamed tokens", mb,
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("llmgw_time_per_output_token_seconds", "(e2e - TTFT) / (output tokens - 1)", mb,
                              buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("llmgw_e2e_request_latency_seconds", "Request latency, first byte in to last out", mb,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("llmgw_request_queue_time_seconds", "Time waiting for the engine's first step", mb,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("llmgw_prompt_tokens", "Prompt tokens served", mb, registry=r)
        self.generation_tokens = Counter("llmgw_generation_tokens", "Tokens generated", mb, registry=r)
        self.fallbacks = Counter("llmgw_fallbacks", "Requests moved to the next tier before their first token",
                                 ["model", "from_backend", "to_backend"], registry=r)
        self.shadow = Counter("llmgw_shadow_comparisons", "Mirrored requests by outcome",
                              ["model", "primary", "candidate", "outcome"], registry=r)
        self.abort_seconds = Histogram("llmgw_abort_seconds", "Cancelled request (client gone, timeout) to its "
                                       "resources freed: engine KV blocks, or the upstream request closed",
                                       ["backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.retries = Counter("llmgw_retries", "Retries of a backend before its first token", ["model", "backend"],
                               registry=r)
        self.upstream_errors = Counter("llmgw_upstream_errors", "Backend errors by kind", ["backend", "kind"],
                                       registry=r)
        self.engine_batch = Histogram("llmgw_engine_batch_size", "Sequences per engine step", ["backend"],
                                      buckets=COUNT_BUCKETS, registry=r)
        self.engine_tokens = Histogram("llmgw_engine_tokens_per_step", "Tokens computed per engine step", ["backend"],
                                       buckets=COUNT_BUCKETS, registry=r)
        self.engine_step = Histogram("llmgw_engine_step_seconds", "Engine step time", ["backend"],
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.tgi = TgiMetrics() if tgi_compatible else None
        self._state_sources: list[Callable[[], Iterator[Metric]]] = []
        r.register(_StateCollector(self._state_sources))

    def add_state_source(self, source: Callable[[], Iterator[Metric]]) -> None:
        """Gauges read at scrape time (engine state, backend health)."""
        self._state_sources.append(source)

    def observe_request(self, rec: RequestRecord) -> None:
        labels = (rec.model or "-", rec.backend or "-")
        self.requests.labels(*labels, rec.route or rec.path, str(rec.status), rec.finish_reason or "-").inc()
        if rec.backend:
            duration = (rec.ended or rec.started) - rec.started
            self.e2e.labels(*labels).observe(duration)
            if rec.ttft is not None:
                self.ttft.labels(*labels).observe(rec.ttft)
                if rec.generated_tokens > 1:
                    self.tpot.labels(*labels).observe((duration - rec.ttft) / (rec.generated_tokens - 1))
            if rec.queue is not None:
                self.queue.labels(*labels).observe(rec.queue)
            self.prompt_tokens.labels(*labels).inc(rec.prompt_tokens)
            self.generation_tokens.labels(*labels).inc(rec.generated_tokens)
        if self.tgi is not None and rec.model:
            self.tgi.observe(rec)

    def render(self) -> bytes:
        text = generate_latest(self.registry)
        return text + self.tgi.render() if self.tgi is not None else text


class _StateCollector:
    def __init__(self, sources: list[Callable[[], Iterator[Metric]]]) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            yield from source()


def gauge(name: str, doc: str, labels: list[str], values: list[tuple[list[str], float]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for label_values, value in values:
        family.add_metric(label_values, value)
    return family


def counter(name: str, doc: str, labels: list[str], values: list[tuple[list[str], float]]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for label_values, value in values:
        family.add_metric(label_values, value)
    return family


def engine_state(engines: Callable[[], dict[str, Any]]) -> Callable[[], Iterator[Metric]]:
    """Scheduler and KV-cache figures of every loaded engine backend, read at scrape time."""

    def collect() -> Iterator[Metric]:
        rows = [(name, llm) for name, llm in engines().items() if llm is not None]
        bm = [(name, llm.block_manager) for name, llm in rows]
        yield gauge("llmgw_engine_running_seqs", "Sequences in the running batch", ["backend"],
                    [([n], len(llm.scheduler.running)) for n, llm in rows])
        yield gauge("llmgw_engine_waiting_seqs", "Sequences waiting", ["backend"],
                    [([n], len(llm.scheduler.waiting)) for n, llm in rows])
        yield gauge("llmgw_engine_kv_blocks_used", "KV blocks in use", ["backend"],
                    [([n], b.num_blocks - b.num_free_blocks) for n, b in bm])
        yield gauge("llmgw_engine_kv_blocks_total", "KV blocks in the pool", ["backend"],
                    [([n], b.num_blocks) for n, b in bm])
        yield gauge("llmgw_engine_kv_usage_ratio", "KV blocks in use / total", ["backend"],
                    [([n], (b.num_blocks - b.num_free_blocks) / b.num_blocks) for n, b in bm])
        yield counter("llmgw_engine_prefix_cache_queries", "Blocks looked up in the prefix cache", ["backend"],
                      [([n], b.prefix_queries) for n, b in bm])
        yield counter("llmgw_engine_prefix_cache_hits", "Prefix-cache blocks reused", ["backend"],
                      [([n], b.prefix_hits) for n, b in bm])
        yield counter("llmgw_engine_preemptions", "Sequences preempted (recomputed later)", ["backend"],
                      [([n], llm.scheduler.num_preemptions) for n, llm in rows])

    return collect
