"""API keys: who may call which model, and with which limits.

Keys come from the config (or environment variables) and, with a state database, from its snapshot
(gateway/store/key_snapshot.py): authenticating never waits on the database. A presented key is found
by its SHA-256 (a dictionary lookup on a digest reveals nothing usable about a secret by its timing);
keys are never logged or echoed, only their names. A rotated key's previous secret keeps working until
its grace period ends. Rate limits and token budgets are counted by gateway/policy/quota.py.
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.config import ApiKey, GatewayConfig
from gateway.errors import GatewayError
from gateway.store.keys import StoredKey
from gateway.store.limits import KeyLimits


@dataclass(frozen=True)
class Principal:
    name: str
    models: frozenset[str]  # canonical model names; empty: every model
    limits: KeyLimits
    key_id: str | None = None  # a stored key's id; None for config keys
    expires_at: float | None = None  # Unix seconds


current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("principal", default=None)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


class KeyRing:
    """Every key the gateway knows now. With a state database every request needs a key, even while
    none is stored (revoking the last key must not open the gateway, nor a database down at start)."""

    def __init__(self, config: GatewayConfig, stored: Iterable[StoredKey] | None = None,
                 store_enabled: bool = False) -> None:
        self.auth = config.auth
        self.store_enabled = store_enabled
        self._by_digest: dict[bytes, tuple[Principal, float | None]] = {}  # digest -> (key, valid until)
        for key in config.auth.keys:
            secret = key.key if key.key is not None else os.environ.get(key.key_env or "", "")
            self._by_digest[_digest(secret)] = (self._config_principal(config, key), None)
        for row in stored or ():
            if row.revoked_at is not None:
                continue
            models = frozenset(found[0] if (found := config.resolve_model(m)) else m for m in row.models)
            principal = Principal(row.name, models, KeyLimits(row.name, row.rpm, row.tpm, row.max_tokens_per_day,
                                                              row.max_tokens_per_month), row.id, row.expires_at)
            self._by_digest[bytes.fromhex(row.secret_hash)] = (principal, None)
            if row.previous_hash and row.previous_expires_at:
                self._by_digest.setdefault(bytes.fromhex(row.previous_hash), (principal, row.previous_expires_at))
        self.count = len({p.name for p, _ in self._by_digest.values()})

    @staticmethod
    def _config_principal(config: GatewayConfig, key: ApiKey) -> Principal:
        models = frozenset(found[0] for m in key.models if (found := config.resolve_model(m)) is not None)
        return Principal(key.name, models, KeyLimits(key.name, key.requests_per_minute, key.tokens_per_minute,
                                                     key.max_tokens_per_day, key.max_tokens_per_month))

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest) or self.store_enabled

    def principals(self) -> list[Principal]:
        return list({p.name: p for p, until in self._by_digest.values() if until is None}.values())

    def authenticate(self, header: str | None) -> Principal:
        presented = bearer(header)
        if presented is None:
            raise GatewayError("an API key is needed (Authorization: Bearer <key>, or x-api-key: <key>)",
                               kind="unauthorized", code="missing_api_key")
        found = self._by_digest.get(_digest(presented))
        now = time.time()
        if found is None or (found[1] is not None and now > found[1]):
            raise GatewayError("invalid API key", kind="unauthorized", code="invalid_api_key")
        principal = found[0]
        if principal.expires_at is not None and now > principal.expires_at:
            raise GatewayError(f"API key '{principal.name}' has expired", kind="unauthorized", code="expired_api_key")
        return principal

    @staticmethod
    def authorize(principal: Principal | None, model: str) -> None:
        """The key may use `model`."""
        if principal is not None and principal.models and model not in principal.models:
            raise GatewayError(f"this API key may not use model '{model}'", kind="forbidden",
                               code="model_not_allowed", param="model")
