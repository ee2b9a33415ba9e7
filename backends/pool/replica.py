"""One replica of a pool: its backend, the pool's own bookkeeping of what it sent there, its health
(active checks and passive ejection, the gateway's per-backend rule applied per replica) and the
load figures it last reported."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec

from backends.base import Backend
from backends.pool.signals import ReplicaSignals

log = logging.getLogger("llmgw")


class HealthNews(msgspec.Struct, array_like=True, frozen=True):
    """A change of one replica's health that one front of the gateway saw, for its other fronts
    (gateway/serving/front_feed.py): an ejection it made after failures, or an active check that changed the state."""

    replica: str
    ejected_for: float = 0.0  # seconds of the ejection; 0: not an ejection
    check_failed: bool | None = None  # the check's new state; None: not a check


@dataclass
class Replica:
    id: str  # its base URL (or worker name): the `replica` label in metrics and the access log
    backend: Backend
    in_flight: int = 0  # requests this gateway has on it now
    outstanding_tokens: int = 0  # their prompt tokens (estimated) + tokens still to generate
    requests: int = 0  # requests sent, ever
    started: bool = False
    # health
    consecutive_failures: int = 0
    open_until: float = 0.0  # ejected until this monotonic time
    check_failed: bool = False  # the last active health check failed
    ejections: int = 0
    signals: ReplicaSignals = field(default_factory=ReplicaSignals)  # last scrape; `at` 0: never
    owners: int = 1  # pools using this object (a reload hands unchanged replicas to the new pool)

    def available(self, now: float | None = None) -> bool:
        return self.started and not self.check_failed and (now or time.monotonic()) >= self.open_until

    def load(self, stale_after: float, now: float | None = None) -> float:
        """Requests on the replica: what it reported (all its clients), when fresh, but never less
        than what this gateway knows it sent (the report lags behind the last few requests)."""
        reported = 0.0
        if self.signals.fresh(stale_after, now):
            reported = (self.signals.waiting or 0.0) + (self.signals.running or 0.0)
        return max(float(self.in_flight), reported)

    def queueing(self, stale_after: float, now: float | None = None) -> bool:
        """Whether requests wait on the replica for a place in its batch: what it reported, when fresh;
        without such a report the gateway cannot tell waiting from running, so yes."""
        if self.signals.fresh(stale_after, now) and self.signals.waiting is not None:
            return self.signals.waiting > 0
        return True

    def kv_usage(self, stale_after: float, now: float | None = None) -> float:
        fresh = self.signals.fresh(stale_after, now) and self.signals.kv_usage is not None
        return float(self.signals.kv_usage or 0.0) if fresh else 0.0

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.open_until = 0.0

    def record_failure(self, eject_after: int, cooldown: float, pool: str) -> bool:
        """True when this failure ejects the replica."""
        self.consecutive_failures += 1
        if self.consecutive_failures >= eject_after and time.monotonic() >= self.open_until:
            self.open_until = time.monotonic() + cooldown
            self.ejections += 1
            log.warning("backend %s: replica %s ejected for %.0f s after %d consecutive failures", pool, self.id,
                        cooldown, self.consecutive_failures)
            return True
        return False

    def record_check(self, healthy: bool, pool: str) -> None:
        if healthy and self.check_failed:
            log.info("backend %s: replica %s passes its health check again", pool, self.id)
        elif not healthy and not self.check_failed:
            log.warning("backend %s: replica %s fails its health check", pool, self.id)
        self.check_failed = not healthy

    def hear(self, news: HealthNews, pool: str) -> None:
        """Another front's news of this replica: ejected there, so here too (its failures were requests like
        these); a check that changed there, so the same state here until the next check says otherwise."""
        if news.ejected_for > 0:
            self.open_until = max(self.open_until, time.monotonic() + news.ejected_for)
            log.info("backend %s: replica %s ejected for %.0f s by another front", pool, self.id, news.ejected_for)
        if news.check_failed is not None:
            self.record_check(not news.check_failed, pool)

    def state(self) -> str:
        if not self.started:
            return "starting"
        if self.check_failed:
            return "unhealthy"
        return "ejected" if time.monotonic() < self.open_until else "healthy"
