"""API keys, their limits and what they used: everything `[auth]` and `[state]` configure, in one place
the Gateway holds. Without `[state]`: config keys, per-process limits, stored Responses in memory, no
usage rows. With it: stored keys too (from a snapshot), usage rows, persisted Responses, and limits
shared through Redis when `redis` is set."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from gateway.config import GatewayConfig
from gateway.policy.auth import KeyRing
from gateway.policy.quota import Quota
from gateway.responses_store import MemoryResponses
from gateway.serving.fronts import front_count
from gateway.store.keys import StoredKey
from gateway.store.limits import make_limiter
from gateway.store.responses import PersistedResponses
from gateway.store.state_store import StateStore
from gateway.store.usage import usage_row
from gateway.telemetry.record import RequestRecord

log = logging.getLogger("llmgw")
RECHECK_SECONDS = 0.25


class Accounts:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        state = config.state
        share = 1.0 / front_count()  # without Redis, each of N front processes enforces 1/N of a limit
        self.quota = Quota(make_limiter(state.resolved_redis(), state.fail_open, lease_fraction=state.lease_fraction,
                                        share=share) if state is not None else make_limiter(None, share=share))
        self.store = StateStore(state, self.quota.limiter, self._stored_keys) if state is not None else None
        self.keys = KeyRing(config, None, store_enabled=self.store is not None)
        self._recheck: asyncio.Future[bool] | None = None
        self._recheck_at = 0.0
        self.responses: MemoryResponses | PersistedResponses = (
            self.store.responses if self.store is not None else MemoryResponses())

    async def open(self) -> None:
        if self.store is not None:
            await self.store.open()

    async def recheck(self) -> bool:
        """A key not in the snapshot: the stored keys read again, at most once every RECHECK_SECONDS (all the
        misses meanwhile wait for that one read). So a key works at once on every front and replica, not
        after the next refresh, and a flood of wrong keys costs a few reads a second. False: no store."""
        if self.store is None:
            return False
        now = time.monotonic()
        if self._recheck is None or (self._recheck.done() and now - self._recheck_at >= RECHECK_SECONDS):
            self._recheck_at = now
            self._recheck = asyncio.ensure_future(self.store.snapshot.refresh())
        return await asyncio.shield(self._recheck)

    def _stored_keys(self, keys: list[StoredKey]) -> None:
        self.keys = KeyRing(self.config, keys, store_enabled=True)

    def reconfigure(self, new: GatewayConfig) -> None:
        """A reload: the config's keys change at once (`[state]` changes only with a restart: Gateway.reload)."""
        self.config = new
        stored = self.store.snapshot.keys if self.store is not None else None
        self.keys = KeyRing(new, stored, store_enabled=self.store is not None)

    def record(self, rec: RequestRecord) -> None:
        """A finished request's usage row (generation routes: those that resolved a model)."""
        if self.store is not None and self.store.usage is not None and rec.model:
            self.store.usage.record(usage_row(rec, rec.key_name, self.store.config.log_content))

    def status(self) -> dict[str, Any] | None:
        return self.store.status() if self.store is not None else None

    async def aclose(self) -> None:
        if self.store is not None:
            await self.store.aclose()
        await self.quota.aclose()
