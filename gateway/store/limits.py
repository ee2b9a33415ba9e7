"""Per-key limits shared by gateway replicas: requests and tokens per minute, tokens per UTC day and month.

Admission reserves tokens up front (prompt + max_tokens) and settles the real count when the request ends,
so day/month budgets are strict under concurrency. Reservations expire (a gateway that dies between admit
and settle leaks nothing). The per-minute buckets are lenient the OpenAI way: a request is admitted while
the tpm bucket holds a token and may overdraw it. LocalLimiter keeps the counts in this process;
RedisLimiter (redis_limits.py) shares them between replicas.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.store.limit_leases import Lease

RPM, TPM, PER_DAY, PER_MONTH = "requests per minute", "tokens per minute", "tokens per day", "tokens per month"


@dataclass(frozen=True)
class KeyLimits:
    key: str  # the API key's name (unique); the identity in Redis keys
    rpm: int | None = None
    tpm: int | None = None  # prompt + completion tokens
    tokens_per_day: int | None = None  # UTC calendar day
    tokens_per_month: int | None = None  # UTC calendar month
    limited: bool = field(init=False, compare=False)  # any limit at all (read on every request: worked out once)

    def __post_init__(self) -> None:
        object.__setattr__(self, "limited", any(v is not None for v in (self.rpm, self.tpm, self.tokens_per_day,
                                                                         self.tokens_per_month)))


@dataclass
class Reservation:
    limits: KeyLimits
    amount: int  # tokens reserved (prompt + max_tokens)
    id: str  # uuid4 hex
    day: str  # "20261204" UTC: the windows it was charged to ("" when leased: no budget window)
    month: str  # "202612"
    enforced: bool = True  # False: the shared store was unreachable and fail_open let it through
    settled: bool = False
    lease: Lease | None = None  # admitted from this replica's share of the per-minute buckets (limit_leases.py)


class LimitExceeded(Exception):
    def __init__(self, what: str, limit: int, retry_after: float, key: str = "") -> None:
        self.what, self.limit, self.retry_after, self.key = what, limit, retry_after, key
        who = f" for API key '{key}'" if key else ""
        super().__init__(f"rate limit reached{who}: {limit} {what}")

    @property
    def retry_after_s(self) -> int:
        """Whole seconds for a Retry-After header (at least 1)."""
        return max(1, math.ceil(self.retry_after))


class LimiterUnavailable(Exception):
    """The shared store is unreachable and fail_open is false."""


class Limiter(Protocol):
    shared: bool  # True: counts shared by every gateway replica (Redis); False: this process only

    async def admit(self, limits: KeyLimits, amount: int, count_request: bool = True) -> Reservation: ...
    async def settle(self, reservation: Reservation, used: int) -> None: ...
    def settle_at_once(self, reservation: Reservation, used: int) -> bool:
        """Settle now if that needs no I/O (then True); else the caller awaits settle()."""
        ...
    def seed(self, key: str, day_used: int, month_used: int) -> None: ...
    def status(self) -> dict[str, object]: ...
    async def aclose(self) -> None: ...


def periods(now: float) -> tuple[str, str, float, float]:
    """(day, month, seconds to the next UTC midnight, seconds to the next UTC month) at unix time `now`."""
    t = datetime.fromtimestamp(now, UTC)
    midnight = datetime(t.year, t.month, t.day, tzinfo=UTC).timestamp() + 86400
    next_month = datetime(t.year + t.month // 12, t.month % 12 + 1, 1, tzinfo=UTC).timestamp()
    return t.strftime("%Y%m%d"), t.strftime("%Y%m"), midnight - now, next_month - now


@dataclass
class _Window:
    period: str
    used: int = 0
    reserved: int = 0
    holds: dict[str, tuple[int, float]] = field(default_factory=dict)  # id -> (amount, expiry)


@dataclass
class _Bucket:
    level: float
    stamp: float

    def refill(self, capacity: int, now: float) -> float:
        self.level = min(float(capacity), self.level + max(0.0, now - self.stamp) * capacity / 60.0)
        self.stamp = now
        return self.level


class LocalLimiter:
    """Counts in this process only: each replica enforces the limits on its own. admit never awaits, so
    check-and-take is atomic on the event loop."""

    shared = False

    def __init__(self, reservation_ttl: float = 600.0, clock: Callable[[], float] = time.time,
                 share: float = 1.0) -> None:
        self.reservation_ttl = reservation_ttl
        self.share = share  # one front of N without Redis enforces 1/N of every limit (gateway/serving/fronts.py)
        self._parts: dict[KeyLimits, KeyLimits] = {}
        self._clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._windows: dict[tuple[str, str], _Window] = {}  # (key, "d"|"m") -> the current period's window
        self._expired = 0

    def _window(self, key: str, kind: str, period: str) -> _Window:
        w = self._windows.get((key, kind))
        if w is None or w.period != period:  # a new day or month starts from zero
            w = self._windows[(key, kind)] = _Window(period)
        return w

    def _bucket(self, key: str, kind: str, capacity: int, now: float) -> _Bucket:
        b = self._buckets.setdefault((key, kind), _Bucket(float(capacity), now))
        b.refill(capacity, now)
        return b

    def _part(self, limits: KeyLimits) -> KeyLimits:
        """This process's part of a key's limits: all of them, or its share (at least 1 of each)."""
        part = self._parts.get(limits)
        if part is None:
            def cut(value: int | None) -> int | None:
                return None if value is None else max(1, int(value * self.share))

            part = self._parts[limits] = KeyLimits(limits.key, cut(limits.rpm), cut(limits.tpm),
                                                   cut(limits.tokens_per_day), cut(limits.tokens_per_month))
        return part

    async def admit(self, limits: KeyLimits, amount: int, count_request: bool = True) -> Reservation:
        now = self._clock()
        day, month, to_midnight, to_month = periods(now)
        if self.share < 1.0:
            limits = self._part(limits)
        key = limits.key
        windows: list[tuple[_Window, int, str, float]] = []
        for kind, period, limit, what, wait in (("d", day, limits.tokens_per_day, PER_DAY, to_midnight),
                                                ("m", month, limits.tokens_per_month, PER_MONTH, to_month)):
            if limit is not None:
                w = self._window(key, kind, period)
                for rid in [rid for rid, (_, exp) in w.holds.items() if exp <= now]:
                    w.reserved -= w.holds.pop(rid)[0]
                    self._expired += 1
                windows.append((w, limit, what, wait))
        rpm = self._bucket(key, "rpm", limits.rpm, now) if limits.rpm is not None and count_request else None
        if rpm is not None and limits.rpm is not None and rpm.level < 1:
            raise LimitExceeded(RPM, limits.rpm, (1 - rpm.level) * 60 / max(limits.rpm, 1), key)
        tpm = self._bucket(key, "tpm", limits.tpm, now) if limits.tpm is not None else None
        if tpm is not None and limits.tpm is not None and tpm.level < 1:  # at least one token left
            raise LimitExceeded(TPM, limits.tpm, (1 - tpm.level) * 60 / max(limits.tpm, 1), key)
        for w, limit, what, wait in windows:
            if w.used + w.reserved + amount > limit:
                raise LimitExceeded(what, limit, wait, key)
        r = Reservation(limits, amount, uuid.uuid4().hex, day, month)
        if rpm is not None:
            rpm.level -= 1
        if tpm is not None:
            tpm.level -= amount
        for w, *_ in windows:
            w.reserved += amount
            w.holds[r.id] = (amount, now + self.reservation_ttl)
        return r

    async def settle(self, reservation: Reservation, used: int) -> None:
        self.settle_at_once(reservation, used)

    def settle_at_once(self, reservation: Reservation, used: int) -> bool:
        """Always at once: the counts are in this process."""
        if reservation.settled:
            return True
        reservation.settled = True
        limits, key = reservation.limits, reservation.limits.key
        for kind, period, limit in (("d", reservation.day, limits.tokens_per_day),
                                    ("m", reservation.month, limits.tokens_per_month)):
            w = self._windows.get((key, kind))
            if limit is None or w is None or w.period != period:
                continue  # that day or month is over: nothing left to correct
            held = w.holds.pop(reservation.id, None)
            if held is not None:  # not expired meanwhile
                w.reserved -= held[0]
            w.used += used
        if limits.tpm is not None:
            b = self._bucket(key, "tpm", limits.tpm, self._clock())
            b.level = min(float(limits.tpm), b.level + reservation.amount - used)
        return True

    def seed(self, key: str, day_used: int, month_used: int) -> None:
        day, month, _, _ = periods(self._clock())
        self._window(key, "d", day).used = int(day_used * self.share)  # of a shared budget: this front's share
        self._window(key, "m", month).used = int(month_used * self.share)

    def status(self) -> dict[str, object]:
        return {"shared": False, "available": True, "errors": 0, "unenforced": 0,
                "expired_reservations": self._expired}

    async def aclose(self) -> None:
        pass


def make_limiter(redis_url: str | None, fail_open: bool = True, reservation_ttl: float = 600.0,
                 lease_fraction: float = 0.01, share: float = 1.0) -> Limiter:
    """Limits shared through Redis, else counted here (`share`: the part of each a process of N enforces)."""
    if not redis_url:
        return LocalLimiter(reservation_ttl, share=share)
    from gateway.store.redis_limits import RedisLimiter

    return RedisLimiter(redis_url, fail_open=fail_open, reservation_ttl=reservation_ttl,
                        lease_fraction=lease_fraction)
