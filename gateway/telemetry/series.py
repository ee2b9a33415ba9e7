"""Per-backend time series of the last half hour, in fixed buckets, for the console's charts.

Prometheus has the same numbers, but the console must work with nothing but the gateway: so each finished
request (a `Gateway.request_observers` entry) lands in the bucket of its end time. Memory is bounded: at most
`horizon / bucket` buckets per backend, each with at most `MAX_SAMPLES` latency samples (reservoir sampling past
that, so a busy bucket's percentiles stay unbiased), and a backend with no request in the horizon is forgotten.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gateway.telemetry.record import RequestRecord

MAX_SAMPLES = 128  # latency samples kept per bucket and kind: plenty for a chart, about 3 MB per busy backend


@dataclass
class Bucket:
    index: int  # its start is index * bucket_s, unix seconds (an int: matching floats would be fragile)
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    seen_ttft: int = 0  # samples offered, for the reservoir
    seen_tpot: int = 0


def _keep(samples: list[float], seen: int, value: float, rng: random.Random) -> None:
    """Reservoir sampling (Algorithm R): each of the `seen` values offered so far is kept with equal chance."""
    if len(samples) < MAX_SAMPLES:
        samples.append(value)
    elif (slot := rng.randrange(seen)) < MAX_SAMPLES:
        samples[slot] = value


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def is_error(rec: RequestRecord) -> bool:
    """A server-side failure: 5xx or a backend error. Client errors (4xx) and clients that left (499) are not."""
    return rec.status >= 500 or bool(rec.error)


def tpot(rec: RequestRecord) -> float | None:
    """Seconds per output token after the first: the decode speed the client saw."""
    if rec.ttft is None or rec.ended is None or rec.generated_tokens < 2:
        return None
    return max(0.0, rec.ended - rec.started - rec.ttft) / (rec.generated_tokens - 1)


class BackendSeries:
    def __init__(self, bucket_s: float = 5.0, horizon_s: float = 1800.0, clock: Any = time.time) -> None:
        self.bucket_s = bucket_s
        self.horizon_s = horizon_s
        self.clock = clock  # unix seconds; a test passes its own
        self.buckets: dict[str, deque[Bucket]] = {}  # by backend, oldest first
        self.rng = random.Random(0)

    def observe(self, rec: RequestRecord) -> None:
        if not rec.backend:  # not a generation (health, admin, a request refused before routing)
            return
        now = self.clock()
        index = int(now // self.bucket_s)
        buckets = self.buckets.setdefault(rec.backend, deque())
        if not buckets or buckets[-1].index < index:
            buckets.append(Bucket(index))
        self._expire(now)
        bucket = buckets[-1]
        bucket.requests += 1
        bucket.errors += is_error(rec)
        bucket.tokens += rec.generated_tokens
        if rec.ttft is not None:
            bucket.seen_ttft += 1
            _keep(bucket.ttft, bucket.seen_ttft, rec.ttft, self.rng)
        if (per_token := tpot(rec)) is not None:
            bucket.seen_tpot += 1
            _keep(bucket.tpot, bucket.seen_tpot, per_token, self.rng)

    def _expire(self, now: float) -> None:
        oldest = int((now - self.horizon_s) // self.bucket_s)
        for name in list(self.buckets):
            buckets = self.buckets[name]
            while buckets and buckets[0].index <= oldest:
                buckets.popleft()
            if not buckets:
                del self.buckets[name]

    def snapshot(self, seconds: float, backends: list[str] | None = None) -> dict[str, Any]:
        """The last `seconds` (at most the horizon) as one array per measure and backend, one element per bucket,
        empty buckets included: request and token rates are 0 there, the error rate and latencies None (no data,
        which a chart draws as a gap). `backends` adds backends with no data yet (all-empty arrays)."""
        now = self.clock()
        self._expire(now)
        seconds = max(self.bucket_s, min(float(seconds), self.horizon_s))
        last = int(now // self.bucket_s)
        indexes = range(last - int(seconds // self.bucket_s) + 1, last + 1)
        out: dict[str, Any] = {}
        for name in sorted({*self.buckets, *(backends or [])}):
            by_index = {b.index: b for b in self.buckets.get(name, ())}
            rows = [by_index.get(i) for i in indexes]
            out[name] = {
                "t": [i * self.bucket_s for i in indexes],
                "requests_per_s": [b.requests / self.bucket_s if b else 0.0 for b in rows],
                "tokens_per_s": [b.tokens / self.bucket_s if b else 0.0 for b in rows],
                "error_rate": [b.errors / b.requests if b and b.requests else None for b in rows],
                "ttft_p50_s": [_percentile(b.ttft, 0.5) if b else None for b in rows],
                "ttft_p95_s": [_percentile(b.ttft, 0.95) if b else None for b in rows],
                "tpot_p50_s": [_percentile(b.tpot, 0.5) if b else None for b in rows],
            }
        return {"bucket_s": self.bucket_s, "now": now, "backends": out}
