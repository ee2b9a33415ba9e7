"""Connecting to the state database and keeping its schema current.

URLs are the user's (`sqlite:///path`, `postgresql://user@host/db`); the async driver is ours to pick
(aiosqlite, asyncpg). SQLite runs in WAL mode, so readers never wait on the usage writer. The schema is
Alembic's: `llmgw state migrate` (or `[state] auto_migrate`) upgrades it to this version's head, and a
gateway refuses a database whose revision it does not know (older: not migrated; newer: a newer
gateway migrated it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


class SchemaError(Exception):
    """The database's schema is not the one this gateway was built for."""


def async_url(url: str) -> str:
    """The SQLAlchemy URL with our async driver: sqlite → aiosqlite, postgresql → asyncpg."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a database URL: {url!r} (expected sqlite:///PATH or postgresql://...)")
    base = scheme.split("+")[0]
    if base == "sqlite":
        return f"sqlite+aiosqlite://{rest}"
    if base in ("postgresql", "postgres"):
        return f"postgresql+asyncpg://{rest}"
    raise ValueError(f"unsupported database {scheme!r} (sqlite or postgresql)")


def is_postgres(url: str) -> bool:
    return url.split("://")[0].split("+")[0] in ("postgresql", "postgres")


def plain_postgres_dsn(url: str) -> str:
    """The URL as libpq and asyncpg.connect take it (no SQLAlchemy driver suffix)."""
    return "postgresql://" + url.partition("://")[2]


def sqlite_path(url: str) -> Path | None:
    if not url.startswith("sqlite"):
        return None
    path = url.partition(":///")[2].split("?")[0]
    return Path(path) if path and path != ":memory:" else None


def connect(url: str, timeout: float = 5.0) -> AsyncEngine:
    """An engine for `url`; a SQLite file's folder is made, and each connection set to WAL."""
    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(async_url(url), connect_args={"timeout": timeout})

        @sa.event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")  # WAL's safe setting: a crash loses no committed row
            cursor.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
            cursor.close()

        return engine
    # pool_pre_ping: a connection broken by a database restart is replaced, not handed to a query
    return create_async_engine(async_url(url), pool_size=5, max_overflow=5, pool_pre_ping=True,
                               connect_args={"timeout": timeout, "command_timeout": timeout})


def _alembic(connection: sa.Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(_alembic()).get_current_head()
    assert head is not None
    return head


async def current_revision(conn: AsyncConnection) -> str | None:
    return await conn.run_sync(lambda sync: MigrationContext.configure(sync).get_current_revision())


async def migrate(engine: AsyncEngine) -> tuple[str | None, str]:
    """Upgrade the schema to head; returns (revision before, revision now)."""
    async with engine.begin() as conn:
        before = await current_revision(conn)
        await conn.run_sync(lambda sync: command.upgrade(_alembic(sync), "head"))
    return before, head_revision()


async def check_schema(engine: AsyncEngine) -> None:
    """Raise SchemaError unless the database is at this gateway's head revision."""
    async with engine.connect() as conn:
        current = await current_revision(conn)
    head = head_revision()
    if current == head:
        return
    known = {script.revision for script in ScriptDirectory.from_config(_alembic()).walk_revisions()}
    if current is None:
        raise SchemaError("the state database has no schema yet: run `llmgw state migrate` "
                          "(or set [state] auto_migrate = true)")
    if current in known:
        raise SchemaError(f"the state database is at revision {current}, this gateway needs {head}: "
                          "run `llmgw state migrate`")
    raise SchemaError(f"the state database is at revision {current}, unknown to this gateway (head {head}): "
                      "a newer gateway migrated it; run that version, or restore a backup")
