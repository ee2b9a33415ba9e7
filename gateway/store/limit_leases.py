"""Per-minute limits leased from Redis, so a request of a busy key does not wait on a round trip.

A replica takes a share of a key's requests-per-minute and tokens-per-minute buckets out of Redis at once
(`lease_fraction` of the limit, 1% by default) and admits from that share in memory until it runs out or is
a second old; then the rest goes back to the buckets and a new share is taken. The tokens are taken out
of the shared buckets before they are used, so the replicas together admit what one counter would, give
or take what a replica holds: at most a lease per replica. A key whose limits are too tight for a lease
of MIN_REQUESTS requests (or of one request's tokens), and any key with a day or month budget, asks Redis
on every request: budgets stay exact under concurrency. Envoy's and Doorman's quota leases work this way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gateway.store.limits import KeyLimits

LEASE_SECONDS = 1.0  # how long a share is used before it goes back (the limits may have changed meanwhile)
MIN_REQUESTS = 10  # below this share of a key's rpm, every request asks Redis


@dataclass
class Lease:
    """A replica's share of one key's per-minute buckets."""

    limits: KeyLimits
    taken: float  # time.monotonic() of the first grant
    requests: int = 0
    tokens: int = 0
    returned: bool = False

    def usable(self, limits: KeyLimits, now: float) -> bool:
        return (self.limits is limits or self.limits == limits) and now - self.taken < LEASE_SECONDS

    def _need(self, amount: int, count_request: bool) -> tuple[int, int]:
        """(requests, tokens) the request takes from this share: only what the key limits."""
        return (1 if count_request and self.limits.rpm is not None else 0,
                amount if self.limits.tpm is not None else 0)

    def shortfall(self, amount: int, count_request: bool) -> tuple[int, int]:
        """(requests, tokens) this lease lacks to admit the request."""
        requests, tokens = self._need(amount, count_request)
        return max(0, requests - self.requests), max(0, tokens - self.tokens)

    def take(self, amount: int, count_request: bool) -> bool:
        """Admit from this share if it holds enough (on every request of a leased key: kept to a few compares)."""
        requests, tokens = self._need(amount, count_request)
        if requests > self.requests or tokens > self.tokens:
            return False
        self.requests -= requests
        self.tokens -= tokens
        return True

    def refund(self, tokens: int) -> bool:
        """Tokens a finished request reserved but did not use; False once the lease went back."""
        if self.returned:
            return False
        self.tokens += tokens
        return True


def lease_sizes(limits: KeyLimits, amount: int, fraction: float) -> tuple[int, int] | None:
    """(requests, tokens) to lease at a time for this key, or None: this request asks Redis itself."""
    sizes = _key_lease_sizes(limits, fraction)
    if sizes is None or (limits.tpm is not None and sizes[1] < amount):
        return None
    return sizes


@functools.lru_cache(maxsize=4096)
def _key_lease_sizes(limits: KeyLimits, fraction: float) -> tuple[int, int] | None:
    """A key's lease sizes whatever the request (worked out once per key and its limits, not per request)."""
    if fraction <= 0 or limits.tokens_per_day is not None or limits.tokens_per_month is not None:
        return None
    requests = tokens = 0
    if limits.rpm is not None:
        requests = int(limits.rpm * fraction)
        if requests < MIN_REQUESTS:
            return None
    if limits.tpm is not None:
        tokens = int(limits.tpm * fraction)
        if tokens < MIN_REQUESTS:
            return None
    return requests, tokens
