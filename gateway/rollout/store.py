"""Rollouts in the state database: the row per model (compare-and-swap on `version`), the decision log,
each replica's window of the current step, and the leader's lease. Every replica reads the same rows, so
they agree on the weights; only the lease holder decides."""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.schema import leases, rollout_decisions, rollout_windows, rollouts

LEASE = "rollouts"


class RolloutStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def load(self) -> dict[str, tuple[int, dict[str, Any]]]:
        """Every rollout: model -> (version, doc)."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(sa.select(rollouts.c.model, rollouts.c.version, rollouts.c.doc))).all()
        return {r.model: (r.version, r.doc) for r in rows}

    async def put(self, model: str, doc: dict[str, Any], version: int | None) -> int | None:
        """Write `doc` if the row is still at `version` (None: there must be no row). The new version, or
        None when another writer got there first."""
        now = time.time()
        async with self.engine.begin() as conn:
            if version is None:
                try:
                    async with conn.begin_nested():
                        await conn.execute(rollouts.insert().values(model=model, version=1, doc=doc, updated_at=now))
                except sa.exc.IntegrityError:
                    return None
                return 1
            done = await conn.execute(rollouts.update()
                                      .where(rollouts.c.model == model, rollouts.c.version == version)
                                      .values(version=version + 1, doc=doc, updated_at=now))
            return version + 1 if done.rowcount == 1 else None

    async def log(self, model: str, decision: dict[str, Any]) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(rollout_decisions.insert().values(model=model, at=decision["at"], doc=decision))

    async def decisions(self, model: str, limit: int = 200) -> list[dict[str, Any]]:
        query = (sa.select(rollout_decisions.c.doc).where(rollout_decisions.c.model == model)
                 .order_by(rollout_decisions.c.id.desc()).limit(limit))
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [r.doc for r in reversed(rows)]

    async def save_window(self, model: str, replica: str, epoch: int, doc: dict[str, Any]) -> None:
        values = {"epoch": epoch, "doc": doc, "updated_at": time.time()}
        async with self.engine.begin() as conn:
            done = await conn.execute(rollout_windows.update().where(rollout_windows.c.model == model,
                                                                     rollout_windows.c.replica == replica)
                                      .values(**values))
            if done.rowcount == 0:
                await conn.execute(rollout_windows.insert().values(model=model, replica=replica, **values))

    async def windows(self, model: str, epoch: int) -> dict[str, dict[str, Any]]:
        """Each replica's window of this step: replica -> doc."""
        query = sa.select(rollout_windows.c.replica, rollout_windows.c.doc).where(
            rollout_windows.c.model == model, rollout_windows.c.epoch == epoch)
        async with self.engine.connect() as conn:
            return {r.replica: r.doc for r in (await conn.execute(query)).all()}

    async def lead(self, holder: str, ttl: float) -> bool:
        """Take or renew the leader's lease; False while another replica holds a live one."""
        now = time.time()
        async with self.engine.begin() as conn:
            done = await conn.execute(leases.update()
                                      .where(leases.c.name == LEASE,
                                             sa.or_(leases.c.holder == holder, leases.c.expires_at < now))
                                      .values(holder=holder, expires_at=now + ttl))
            if done.rowcount == 1:
                return True
            try:
                async with conn.begin_nested():
                    await conn.execute(leases.insert().values(name=LEASE, holder=holder, expires_at=now + ttl))
            except sa.exc.IntegrityError:
                return False
            return True

    async def leader(self) -> str | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(leases.c.holder, leases.c.expires_at)
                                      .where(leases.c.name == LEASE))).first()
        return row.holder if row is not None and row.expires_at >= time.time() else None

    async def resign(self, holder: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(leases.delete().where(leases.c.name == LEASE, leases.c.holder == holder))
