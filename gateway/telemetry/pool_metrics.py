"""Replica pools on /metrics and in the access log: per replica requests, in flight, TTFT, errors,
ejections and the balancer's choices with their reason; its health and the load it reported."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.core import Metric

from gateway.telemetry.metrics import LATENCY_BUCKETS, GatewayMetrics, gauge
from gateway.telemetry.record import current_record

BR = ["backend", "replica"]
KV_BYTES_BUCKETS = tuple(2.0**k for k in range(16, 34, 2))  # 64 KiB .. 8 GiB


class PoolTelemetry:
    """The gateway's observer of every pool (backends/pool/pool.py `PoolObserver`)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        r = metrics.registry
        self.requests = Counter("llmgw_replica_requests", "Requests sent to each replica of a pool", BR, registry=r)
        self.choices = Counter("llmgw_balancer_choices", "The balancer's choices by replica and reason "
                               "(prefix_hit, cold, imbalanced, least_load, round_robin)", [*BR, "reason"],
                               registry=r)
        self.ttft = Histogram("llmgw_replica_time_to_first_token_seconds", "Request sent to a replica to its "
                              "first event", BR, buckets=LATENCY_BUCKETS, registry=r)
        self.errors = Counter("llmgw_replica_errors", "Replica errors by kind", [*BR, "kind"], registry=r)
        self.ejections = Counter("llmgw_replica_ejections", "Passive ejections of a replica (consecutive "
                                 "failures)", BR, registry=r)
        self.pd_requests = Counter("llmgw_pd_requests", "Requests of a prefill/decode pool by path: local (the "
                                   "decode replica alone), remote (prefilled on a prefill replica, KV handed over), "
                                   "fallback (the handover failed; the decode replica prefilled)", ["backend", "path"],
                                   registry=r)
        self.pd_bytes = Histogram("llmgw_pd_kv_transfer_bytes", "KV bytes handed from a prefill to a decode replica",
                                  ["backend"], buckets=KV_BYTES_BUCKETS, registry=r)
        self.pd_seconds = Histogram("llmgw_pd_kv_transfer_seconds", "Time to write and read in a KV handover",
                                    ["backend"], buckets=LATENCY_BUCKETS, registry=r)

    def chosen(self, pool: str, replica: str, reason: str) -> None:
        self.requests.labels(pool, replica).inc()
        self.choices.labels(pool, replica, reason).inc()
        rec = current_record.get()  # the pool runs in the request's context
        if rec is not None:
            rec.replica, rec.balance = replica, reason

    def first_token(self, pool: str, replica: str, seconds: float) -> None:
        self.ttft.labels(pool, replica).observe(seconds)

    def handed_over(self, pool: str, handover: Any) -> None:
        """A prefill/decode pool's request ended: which path it took and what moved."""
        self.pd_requests.labels(pool, handover.path).inc()
        if handover.num_bytes:
            self.pd_bytes.labels(pool).observe(handover.num_bytes)
            self.pd_seconds.labels(pool).observe(handover.seconds)
        rec = current_record.get()
        if rec is not None:
            rec.handover = handover
            rec.replica = handover.decode_replica  # the last chosen may be the prefill replica

    def failed(self, pool: str, replica: str, kind: str) -> None:
        self.errors.labels(pool, replica, kind).inc()

    def ejected(self, pool: str, replica: str) -> None:
        self.ejections.labels(pool, replica).inc()


def pool_state(backends: Callable[[], dict[str, Any]]) -> Callable[[], Iterator[Metric]]:
    """Gauges of every pool's replicas, read at scrape time."""

    def collect() -> Iterator[Metric]:
        rows = []
        for name, backend in backends().items():
            states = getattr(backend, "replica_states", None)
            if states is not None:
                stale = backend.settings.stale_seconds
                rows += [(name, replica, stale) for replica in states()]
        yield gauge("llmgw_replica_in_flight", "Requests on each replica now (this gateway's)", BR,
                    [([n, r.id], r.in_flight) for n, r, _ in rows])
        yield gauge("llmgw_replica_outstanding_tokens", "Prompt and still-to-generate tokens on each replica "
                    "(this gateway's estimate)", BR, [([n, r.id], r.outstanding_tokens) for n, r, _ in rows])
        yield gauge("llmgw_replica_healthy", "1 when the replica passes its health checks and is not ejected", BR,
                    [([n, r.id], float(r.state() == "healthy")) for n, r, _ in rows])
        yield gauge("llmgw_replica_circuit_open", "1 while passive ejection keeps the replica out", BR,
                    [([n, r.id], float(r.state() == "ejected")) for n, r, _ in rows])
        fresh = [(n, r) for n, r, stale in rows if r.signals.fresh(stale)]
        for figure, doc in (("waiting", "Requests waiting"), ("running", "Requests running"),
                            ("kv_usage", "KV-cache usage, 0-1")):
            yield gauge(f"llmgw_replica_reported_{figure}", f"{doc}, as the replica last reported (fresh only)", BR,
                        [([n, r.id], getattr(r.signals, figure)) for n, r in fresh
                         if getattr(r.signals, figure) is not None])

    return collect
