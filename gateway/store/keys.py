"""API keys kept in the state database: create, change, rotate, revoke, and the active ones for the snapshot.

A secret is shown once, when it is made; the table keeps its SHA-256 (secrets are 256 random bits, so
a plain hash is enough: nothing to brute-force) and its last characters as a hint. A rotation keeps the
old hash valid until `previous_expires_at`. Revoking keeps the row (usage rows name it) with
`revoked_at` set. On Postgres every change sends NOTIFY llmgw_keys, so other replicas refresh at once.
"""

from __future__ import annotations

import hashlib
import secrets
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.protocol.keys import KeyCreate, KeyUpdate
from gateway.store.database import is_postgres
from gateway.store.schema import api_keys

SECRET_PREFIX = "sk-llmgw-"
NOTIFY_CHANNEL = "llmgw_keys"
LIMIT_FIELDS = ("rpm", "tpm", "max_tokens_per_day", "max_tokens_per_month")


class NameTaken(Exception):
    pass


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class StoredKey:
    id: str
    name: str
    secret_hash: str
    secret_hint: str
    models: list[str]
    rpm: int | None = None
    tpm: int | None = None
    max_tokens_per_day: int | None = None
    max_tokens_per_month: int | None = None
    expires_at: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0
    revoked_at: float | None = None
    previous_hash: str | None = None
    previous_expires_at: float | None = None

    @classmethod
    def from_row(cls, row: sa.Row[Any]) -> StoredKey:
        return cls(**{name: getattr(row, name) for name in cls.__dataclass_fields__})


def _epoch(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


class KeyStore:
    def __init__(self, engine: AsyncEngine, url: str) -> None:
        self.engine = engine
        self._notify = is_postgres(url)

    async def create(self, body: KeyCreate) -> tuple[StoredKey, str]:
        secret = new_secret()
        now = time.time()
        row = {"id": "key_" + uuid.uuid4().hex[:24], "name": body.name, "secret_hash": secret_hash(secret),
               "secret_hint": secret[-4:], "models": list(body.models), "expires_at": _epoch(body.expires_at),
               "metadata": dict(body.metadata), "created_at": now, "updated_at": now,
               **{name: getattr(body, name) for name in LIMIT_FIELDS}}
        async with self.engine.begin() as conn:
            await self._check_name_free(conn, body.name, None)
            await conn.execute(api_keys.insert().values(**row))
            await self._changed(conn)
        return StoredKey(**row), secret

    async def get(self, key_id: str) -> StoredKey | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(api_keys.select().where(api_keys.c.id == key_id))).first()
        return StoredKey.from_row(row) if row is not None else None

    async def list(self, include_revoked: bool = False) -> list[StoredKey]:
        query = api_keys.select().order_by(api_keys.c.created_at)
        if not include_revoked:
            query = query.where(api_keys.c.revoked_at.is_(None))
        async with self.engine.connect() as conn:
            return [StoredKey.from_row(row) for row in await conn.execute(query)]

    async def update(self, key_id: str, body: KeyUpdate) -> StoredKey | None:
        changes = {name: value for name in KeyUpdate.__struct_fields__
                   if (value := getattr(body, name)) is not msgspec.UNSET}
        if "expires_at" in changes:
            changes["expires_at"] = _epoch(changes["expires_at"])
        return await self._change(key_id, changes, body.name if body.name is not msgspec.UNSET else None)

    async def revoke(self, key_id: str) -> StoredKey | None:
        return await self._change(key_id, {"revoked_at": time.time()})

    async def rotate(self, key_id: str, grace_seconds: float) -> tuple[StoredKey, str] | None:
        secret = new_secret()
        async with self.engine.begin() as conn:
            current = await self._live(conn, key_id)
            if current is None:
                return None
            changes = {"secret_hash": secret_hash(secret), "secret_hint": secret[-4:],
                       "previous_hash": current.secret_hash if grace_seconds > 0 else None,
                       "previous_expires_at": time.time() + grace_seconds if grace_seconds > 0 else None}
            key = await self._write(conn, key_id, changes)
        return key, secret

    async def _change(self, key_id: str, changes: dict[str, Any], new_name: str | None = None) -> StoredKey | None:
        async with self.engine.begin() as conn:
            if await self._live(conn, key_id) is None:
                return None
            if new_name is not None:
                await self._check_name_free(conn, new_name, key_id)
            return await self._write(conn, key_id, changes)

    async def _write(self, conn: AsyncConnection, key_id: str, changes: dict[str, Any]) -> StoredKey:
        await conn.execute(api_keys.update().where(api_keys.c.id == key_id).values(**changes, updated_at=time.time()))
        await self._changed(conn)
        row = (await conn.execute(api_keys.select().where(api_keys.c.id == key_id))).one()
        return StoredKey.from_row(row)

    @staticmethod
    async def _live(conn: AsyncConnection, key_id: str) -> StoredKey | None:
        query = api_keys.select().where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
        row = (await conn.execute(query)).first()
        return StoredKey.from_row(row) if row is not None else None

    @staticmethod
    async def _check_name_free(conn: AsyncConnection, name: str, key_id: str | None) -> None:
        query = sa.select(api_keys.c.id).where(api_keys.c.name == name, api_keys.c.revoked_at.is_(None))
        found = (await conn.execute(query)).scalar()
        if found is not None and found != key_id:
            raise NameTaken(f"a key named {name!r} exists already ({found})")

    async def _changed(self, conn: AsyncConnection) -> None:
        if self._notify:  # delivered when the transaction commits
            await conn.execute(sa.text(f"NOTIFY {NOTIFY_CHANNEL}"))
