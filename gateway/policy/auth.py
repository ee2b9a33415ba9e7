"""API keys: who may call which model, how often, and with how many tokens.

Keys come from the config or from environment variables. A presented key is compared with every
configured key in constant time (its SHA-256 against each key's), so neither its value nor its
position leaks by timing; keys are never logged or echoed, only their names.
Rate limits are token buckets refilled continuously: requests per minute, and prompt plus generated
tokens per minute (charged when a generation ends, so one request may overdraw; the next waits).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import os
import time
from dataclasses import dataclass, field

from gateway.config import GatewayConfig
from gateway.errors import GatewayError


class Bucket:
    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self.capacity = float(per_minute)
        self.level = float(per_minute)
        self.rate = per_minute / 60.0
        self.stamp = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0: now)."""
        self._refill()
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount


@dataclass
class Principal:
    name: str
    models: frozenset[str]  # canonical model names; empty: every model
    requests: Bucket | None = None
    tokens: Bucket | None = None
    digest: bytes = field(default=b"", repr=False)

    def charge_tokens(self, count: int) -> None:
        if self.tokens is not None:
            self.tokens.take(count)


current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("principal", default=None)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


class KeyRing:
    def __init__(self, config: GatewayConfig, previous: KeyRing | None = None) -> None:
        self.auth = config.auth
        self.principals: list[Principal] = []
        kept = {p.name: p for p in previous.principals} if previous else {}
        for key in config.auth.keys:
            secret = key.key if key.key is not None else os.environ.get(key.key_env or "", "")
            models = frozenset(found[0] for m in key.models if (found := config.resolve_model(m)) is not None)
            old = kept.get(key.name)
            principal = Principal(key.name, models, _bucket(key.requests_per_minute, old and old.requests),
                                  _bucket(key.tokens_per_minute, old and old.tokens), _digest(secret))
            self.principals.append(principal)

    @property
    def enabled(self) -> bool:
        return bool(self.principals)

    def authenticate(self, header: str | None) -> Principal:
        presented = bearer(header)
        if presented is None:
            raise GatewayError("an API key is needed (Authorization: Bearer <key>, or x-api-key: <key>)",
                               kind="unauthorized", code="missing_api_key")
        digest = _digest(presented)
        found = None
        for principal in self.principals:  # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(digest, principal.digest):
                found = principal
        if found is None:
            raise GatewayError("invalid API key", kind="unauthorized", code="invalid_api_key")
        return found

    @staticmethod
    def authorize(principal: Principal | None, model: str) -> None:
        """The key may use `model`, and its request bucket has room (one request is taken)."""
        if principal is None:
            return
        if principal.models and model not in principal.models:
            raise GatewayError(f"this API key may not use model '{model}'", kind="forbidden",
                               code="model_not_allowed", param="model")
        for bucket, what in ((principal.requests, "requests"), (principal.tokens, "tokens")):
            if bucket is None:
                continue
            wait = bucket.wait_for(1.0)
            if wait > 0:
                raise GatewayError(f"rate limit reached for API key '{principal.name}': {bucket.per_minute} "
                                   f"{what} per minute", kind="rate_limited", code="rate_limit_exceeded",
                                   headers={"retry-after": str(max(1, round(wait)))})
        if principal.requests is not None:
            principal.requests.take(1.0)


def _bucket(per_minute: int | None, previous: Bucket | None) -> Bucket | None:
    """A bucket with the same limit survives a reload, so a reload does not refill anyone's quota."""
    if per_minute is None:
        return None
    if previous is not None and previous.per_minute == per_minute:
        return previous
    return Bucket(per_minute)

