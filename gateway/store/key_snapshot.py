"""The in-memory copy of the stored keys that authentication reads.

Refreshed every `interval` seconds, and at once when Postgres says the keys changed (LISTEN on the
channel KeyStore NOTIFYs). A failed refresh keeps the last snapshot: known keys keep working while the
database is down, and a key revoked meanwhile stops working at the first refresh after it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from gateway.store.database import is_postgres, plain_postgres_dsn
from gateway.store.keys import NOTIFY_CHANNEL, KeyStore, StoredKey

log = logging.getLogger("llmgw")


class KeySnapshot:
    def __init__(self, store: KeyStore, url: str, interval: float,
                 on_keys: Callable[[list[StoredKey]], None]) -> None:
        self.store, self.url, self.interval, self.on_keys = store, url, interval, on_keys
        self.keys: list[StoredKey] | None = None  # None until the first load
        self.available = False
        self.last_loaded: float | None = None  # time.time() of the last successful refresh
        self.failures = 0
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """Refresh soon (this process changed a key, or Postgres said another did)."""
        self._changed.set()

    async def refresh(self) -> bool:
        try:
            keys = await self.store.list()
        except Exception as exc:
            self.failures += 1
            if self.available or self.keys is None:
                log.warning("key snapshot: the state database failed (%s: %s); keeping %s keys", type(exc).__name__,
                            exc, "no" if self.keys is None else len(self.keys))
            self.available = False
            return False
        if not self.available and self.keys is not None:
            log.info("key snapshot: the state database is back (%d keys)", len(keys))
        self.keys, self.available, self.last_loaded = keys, True, time.time()
        self.on_keys(keys)
        return True

    async def run(self) -> None:
        listener = asyncio.create_task(self._listen()) if is_postgres(self.url) else None
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval):
                        await self._changed.wait()
                self._changed.clear()
                await self.refresh()
        finally:
            if listener is not None:
                listener.cancel()

    async def _listen(self) -> None:
        """LISTEN for key changes on a connection of its own; reconnect after a database outage."""
        import asyncpg

        while True:
            conn: Any = None
            try:
                conn = await asyncpg.connect(plain_postgres_dsn(self.url), timeout=5)
                lost = asyncio.Event()
                conn.add_termination_listener(lambda _conn, lost=lost: lost.set())
                await conn.add_listener(NOTIFY_CHANNEL, lambda *_args: self._changed.set())
                self._changed.set()  # changes made while we were not listening
                await lost.wait()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: S110 - down: the interval refresh reports it; try again shortly
                pass
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()
            await asyncio.sleep(self.interval)
