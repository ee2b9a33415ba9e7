"""Per-API-key metrics (`server.metrics_per_key`), and the state store's health, for /metrics.

Key series are labelled by the key's name, never its secret, and bounded: the first `max_series` names
seen get their own series, later ones count under "other", so a fleet of keys cannot blow up Prometheus.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import Metric

from gateway.telemetry.metrics import counter, gauge
from gateway.telemetry.record import RequestRecord

OTHER = "other"


class KeyMetrics:
    def __init__(self, registry: CollectorRegistry, max_series: int) -> None:
        self.max_series = max_series
        self.names: set[str] = set()
        self.requests = Counter("llmgw_key_requests", "Requests by API key name, model and status",
                                ["key", "model", "status"], registry=registry)
        self.tokens = Counter("llmgw_key_tokens", "Tokens by API key name, model and kind (prompt, completion)",
                              ["key", "model", "kind"], registry=registry)

    def _label(self, name: str) -> str:
        if name in self.names:
            return name
        if len(self.names) < self.max_series:
            self.names.add(name)
            return name
        return OTHER

    def observe(self, rec: RequestRecord) -> None:
        if not rec.key_name or not rec.model:
            return
        key = self._label(rec.key_name)
        self.requests.labels(key, rec.model, str(rec.status)).inc()
        self.tokens.labels(key, rec.model, "prompt").inc(rec.prompt_tokens)
        self.tokens.labels(key, rec.model, "completion").inc(rec.generated_tokens)


def store_state(status: Callable[[], dict[str, Any] | None],
                limiter_status: Callable[[], dict[str, Any]]) -> Callable[[], Iterator[Metric]]:
    """The state database, the usage buffer and the limit store, read at scrape time."""

    def collect() -> Iterator[Metric]:
        limits = limiter_status()
        shared = [str(bool(limits["shared"])).lower()]
        yield gauge("llmgw_limiter_up", "1 while the limit store answers (always 1 for per-process limits)",
                    ["shared"], [(shared, float(bool(limits["available"])))])
        yield counter("llmgw_limiter_unenforced", "Requests let through unlimited: the limit store was unreachable "
                      "and fail_open is on", [], [([], float(limits["unenforced"]))])  # type: ignore[arg-type]
        yield counter("llmgw_limiter_errors", "Failed calls to the limit store", [],
                      [([], float(limits["errors"]))])  # type: ignore[arg-type]
        yield counter("llmgw_limiter_expired_reservations", "Token reservations never settled (a replica died "
                      "mid-request), expired and given back", [],
                      [([], float(limits["expired_reservations"]))])  # type: ignore[arg-type]
        state = status()
        if state is None:
            return
        yield gauge("llmgw_state_store_up", "1 when the last read of the state database worked", [],
                    [([], float(state["available"]))])
        yield gauge("llmgw_state_keys", "Stored API keys in the in-memory snapshot", [], [([], float(state["keys"]))])
        loaded = state["keys_loaded_at"]
        yield gauge("llmgw_state_keys_age_seconds", "Seconds since the key snapshot was last refreshed", [],
                    [([], time.time() - loaded)] if loaded else [])
        yield counter("llmgw_responses_store_failures", "Stored Responses kept on this replica only: the database "
                      "write failed", [], [([], float(state["responses_write_failures"]))])
        usage = state["usage"]
        if usage is None:
            return
        yield gauge("llmgw_usage_buffered_rows", "Usage rows waiting to be written", [],
                    [([], float(usage["buffered"]))])
        yield counter("llmgw_usage_rows_written", "Usage rows written to the state database", [],
                      [([], float(usage["written"]))])
        yield counter("llmgw_usage_rows_dropped", "Usage rows dropped: the buffer was full during a database "
                      "outage (the oldest go first)", [], [([], float(usage["dropped"]))])
        yield counter("llmgw_usage_write_failures", "Failed usage batch writes (retried)", [],
                      [([], float(usage["failures"]))])

    return collect
