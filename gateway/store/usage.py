"""Usage records: one row per request, written in batches off the request path.

`record` only appends to a bounded in-memory buffer. A writer task inserts what is buffered every
`interval` seconds (or sooner once a batch is full). When the database cannot be reached the rows stay
buffered and the writer retries with backoff, so an outage loses nothing unless it outlasts the buffer:
then the oldest rows are dropped and counted. Shutdown flushes what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import sqlite3
import time
from collections import deque
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.schema import usage

log = logging.getLogger("llmgw")
MAX_BACKOFF = 10.0


class UsageWriter:
    def __init__(self, engine: AsyncEngine, capacity: int = 100_000, batch: int = 500, interval: float = 1.0,
                 sqlite_file: Path | None = None) -> None:
        self.engine = engine
        self.sqlite_file = sqlite_file
        self._sqlite: sqlite3.Connection | None = None
        self.capacity, self.batch, self.interval = capacity, batch, interval
        self.buffer: deque[dict[str, Any]] = deque()
        self.written = 0
        self.dropped = 0
        self.failures = 0
        self.writing = 0  # rows taken from the buffer by the write in progress
        self.available = True  # the last write went through
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one writer at a time: the loop, or a flush on shutdown

    def record(self, row: dict[str, Any]) -> None:
        """Buffer one row (never blocks, never raises)."""
        self.buffer.append(row)
        self._trim()
        if len(self.buffer) >= self.batch:
            self._wake.set()

    def _trim(self) -> None:
        while len(self.buffer) > self.capacity:
            self.buffer.popleft()
            self.dropped += 1

    async def run(self) -> None:
        backoff = self.interval
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):
                    await self._wake.wait()
            self._wake.clear()
            backoff = self.interval if await self.flush() else min(MAX_BACKOFF, backoff * 2)

    async def flush(self) -> bool:
        """Write the rows buffered when it was called; False (rows kept) when the database failed.

        Rows that arrive while it writes wait for the next flush: chasing them turned a steady stream of requests
        into a write of a few rows per database round trip, whose per-batch cost (a transaction, a pooled
        connection) the event loop paid for every few requests."""
        async with self._lock:
            pending = len(self.buffer)
            while pending > 0 and self.buffer:
                rows = [self.buffer.popleft() for _ in range(min(self.batch, pending, len(self.buffer)))]
                pending -= len(rows)
                self.writing = len(rows)  # still held here, not written: status() counts them as buffered
                try:
                    if self.sqlite_file is not None:
                        self._write_sqlite(rows)
                    elif self.engine.dialect.driver == "asyncpg":
                        await self._copy_postgres(rows)
                    else:
                        async with self.engine.begin() as conn:
                            await conn.execute(usage.insert(), rows)
                except Exception as exc:  # the database is down, slow or refused: keep the rows, oldest first
                    self.buffer.extendleft(reversed(rows))
                    self._trim()
                    self.failures += 1
                    if self.available:
                        log.warning("usage records: the state database failed (%s: %s); %d rows buffered",
                                    type(exc).__name__, exc, len(self.buffer))
                    self.available = False
                    return False
                finally:
                    self.writing = 0
                self.written += len(rows)
                await asyncio.sleep(0)  # requests go on between batches
                if not self.available:
                    log.info("usage records: the state database is back; buffered rows written")
                self.available = True
        return True

    async def _copy_postgres(self, rows: list[dict[str, Any]]) -> None:
        """PostgreSQL: one binary COPY per batch through asyncpg (copy_records_to_table). SQLAlchemy's
        executemany turned each row's parameters over in Python on the event loop: a tenth of the saturated
        request rate went there once the rest of a request got cheap."""
        async with self.engine.connect() as conn:
            raw = await conn.get_raw_connection()
            await raw.driver_connection.copy_records_to_table(  # type: ignore[union-attr]
                usage.name, records=list(map(_in_column_order, rows)), columns=COLUMNS)

    def _write_sqlite(self, rows: list[dict[str, Any]]) -> None:
        """SQLite: written from the event loop's own thread, one multi-row INSERT per 900 rows (about
        1 ms per 100 rows, between requests). Through aiosqlite's thread each row's step handed the GIL to and from the
        event loop, which then served a sixth fewer requests at saturation."""
        if self._sqlite is None:
            self._sqlite = sqlite3.connect(self.sqlite_file, isolation_level=None, timeout=5.0)
            self._sqlite.execute("PRAGMA journal_mode=WAL")
            self._sqlite.execute("PRAGMA synchronous=NORMAL")
        db = self._sqlite
        try:
            db.execute("BEGIN")
            for start in range(0, len(rows), SQLITE_ROWS_PER_STATEMENT):
                chunk = rows[start:start + SQLITE_ROWS_PER_STATEMENT]
                values = ",".join([f"({','.join('?' * len(COLUMNS))})"] * len(chunk))
                db.execute(f"INSERT INTO usage ({','.join(COLUMNS)}) VALUES {values}",
                           [row[name] for row in chunk for name in COLUMNS])
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    async def aclose(self, timeout: float = 5.0) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self.buffer and await self.flush():
                    pass
        if self.buffer:
            log.error("usage records: %d rows could not be written before shutdown", len(self.buffer))

    def status(self) -> dict[str, Any]:
        return {"available": self.available, "buffered": len(self.buffer) + self.writing, "written": self.written,
                "dropped": self.dropped, "failures": self.failures}


COLUMNS = [c.name for c in usage.columns if c.name != "id"]
_in_column_order = operator.itemgetter(*COLUMNS)  # a row's values as the COPY takes them
SQLITE_ROWS_PER_STATEMENT = 900  # x 17 columns stays under SQLite's 32,766 bound parameters


def usage_row(rec: Any, key_name: str | None, log_content: bool) -> dict[str, Any]:
    """The usage row of a finished request, from its RequestRecord."""
    now = time.time()
    return {"at": now, "day": _utc_day(int(now // 86400)), "request_id": rec.request_id,
            "key_name": key_name, "model": rec.model or None, "backend": rec.backend or None, "route": rec.route,
            "door": door_of(rec.route), "prompt_tokens": rec.prompt_tokens, "completion_tokens": rec.generated_tokens,
            "cached_tokens": rec.cached_tokens, "ttft_ms": None if rec.ttft is None else round(rec.ttft * 1000, 3),
            "duration_ms": round(((rec.ended or time.perf_counter()) - rec.started) * 1000, 3),
            "status": rec.status, "finish_reason": rec.finish_reason or None,
            "prompt_text": rec.prompt_text if log_content else None,
            "output_text": rec.output_text if log_content else None}


@functools.lru_cache(maxsize=4)
def _utc_day(days: int) -> str:
    """YYYY-MM-DD of a day number since the epoch (worked out once a day, not once a request)."""
    return time.strftime("%Y-%m-%d", time.gmtime(days * 86400))


def door_of(route: str) -> str:
    if route.startswith("/v1/messages"):
        return "anthropic"
    if route.startswith("/v1/responses"):
        return "responses"
    if route.startswith("/v1/"):
        return "openai"
    return "tgi"
