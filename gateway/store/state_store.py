"""Everything `[state]` turns on, opened and closed together: the database (schema checked or migrated),
the key store and its snapshot, the usage writer, stored Responses, and their background tasks.

Opening never blocks the gateway on a database that is down: it tries once, and if the database cannot
be reached the gateway starts anyway (config keys work; stored keys once it is reachable) and a task
keeps trying. A schema this gateway does not know stops the start instead: serving it could be wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from gateway.config import StateConfig
from gateway.store.database import SchemaError, check_schema, connect, migrate, sqlite_path
from gateway.store.key_snapshot import KeySnapshot
from gateway.store.keys import KeyStore, StoredKey
from gateway.store.limits import Limiter
from gateway.store.responses import PersistedResponses
from gateway.store.usage import UsageWriter
from gateway.store.usage_report import tokens_used_since

log = logging.getLogger("llmgw")
RETRY_INTERVAL = 5.0


class StateStore:
    def __init__(self, config: StateConfig, limiter: Limiter, on_keys: Callable[[list[StoredKey]], None]) -> None:
        self.config = config
        self.url = config.resolved_database()
        self.engine = connect(self.url)
        self.limiter = limiter
        self.keys = KeyStore(self.engine, self.url)
        self.snapshot = KeySnapshot(self.keys, self.url, config.key_refresh_interval, on_keys)
        self.usage = UsageWriter(self.engine, config.usage_buffer_rows, config.usage_batch_rows,
                                 config.usage_flush_interval, sqlite_path(self.url)) if config.record_usage else None
        self.responses = PersistedResponses(self.engine, config.responses_ttl)
        self.ready = False  # the schema was checked: the store is in use
        self._tasks: list[asyncio.Task[Any]] = []

    async def open(self) -> None:
        """Check (or migrate) the schema and load the keys; a database that is down is retried in the
        background. Raises SchemaError for a schema this gateway cannot use."""
        if not await self._prepare():
            self._tasks.append(asyncio.create_task(self._retry()))
        if self.usage is not None:
            self._tasks.append(asyncio.create_task(self.usage.run()))
        self._tasks.append(asyncio.create_task(self.responses.sweep()))

    async def _prepare(self) -> bool:
        try:
            if self.config.auto_migrate:
                before, now = await migrate(self.engine)
                if before != now:
                    log.info("state database %s migrated: %s -> %s", self.describe(), before, now)
            else:
                await check_schema(self.engine)
        except SchemaError:
            raise
        except Exception as exc:
            log.warning("state database %s unreachable (%s: %s); retrying every %g s", self.describe(),
                        type(exc).__name__, exc, RETRY_INTERVAL)
            return False
        await self.snapshot.refresh()
        await self._seed_limits()
        self.ready = True
        self._tasks.append(asyncio.create_task(self.snapshot.run()))
        return True

    async def _retry(self) -> None:
        while True:
            await asyncio.sleep(RETRY_INTERVAL)
            try:
                if await self._prepare():
                    return
            except SchemaError as exc:  # found only now: refuse the stored keys rather than serve them wrong
                log.error("state database refused: %s", exc)
                return

    async def _seed_limits(self) -> None:
        """A per-replica limiter starts its token budgets from what the usage table says was used."""
        if self.limiter.shared:
            return
        now = time.gmtime()
        with contextlib.suppress(Exception):
            used = await tokens_used_since(self.engine, time.strftime("%Y-%m-%d", now),
                                           time.strftime("%Y-%m-01", now))
            for key, (today, month) in used.items():
                self.limiter.seed(key, today, month)

    def describe(self) -> str:
        """The URL without its password."""
        scheme, _, rest = self.url.partition("://")
        credentials, at, host = rest.rpartition("@")
        return f"{scheme}://{credentials.split(':')[0]}@{host}" if at else self.url

    def status(self) -> dict[str, Any]:
        snap = self.snapshot
        return {"database": self.describe(), "ready": self.ready, "available": snap.available,
                "keys": len(snap.keys or []), "keys_loaded_at": snap.last_loaded,
                "usage": self.usage.status() if self.usage is not None else None,
                "responses_write_failures": self.responses.failures, "limits": self.limiter.status()}

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.usage is not None:
            await self.usage.aclose()
        await self.engine.dispose()
