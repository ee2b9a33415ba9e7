"""`GET /admin/usage`: usage rows summed by key, model, backend and UTC day over a time range."""

from __future__ import annotations

import csv
import io
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.schema import usage

GROUPS = {"key": usage.c.key_name, "model": usage.c.model, "backend": usage.c.backend, "day": usage.c.day,
          "door": usage.c.door}
SUMS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "total_tokens", "errors")


async def usage_summary(engine: AsyncEngine, start: float, end: float, group_by: list[str],
                        key: str | None = None, model: str | None = None) -> list[dict[str, Any]]:
    """One dict per group, ordered by the groups; `start` <= at < `end` (Unix seconds)."""
    columns = [GROUPS[name].label(name) for name in group_by]
    query = sa.select(
        *columns,
        sa.func.count().label("requests"),
        sa.func.coalesce(sa.func.sum(usage.c.prompt_tokens), 0).label("prompt_tokens"),
        sa.func.coalesce(sa.func.sum(usage.c.completion_tokens), 0).label("completion_tokens"),
        sa.func.coalesce(sa.func.sum(usage.c.cached_tokens), 0).label("cached_tokens"),
        sa.func.coalesce(sa.func.sum(usage.c.prompt_tokens + usage.c.completion_tokens), 0).label("total_tokens"),
        sa.func.count().filter(usage.c.status >= 400).label("errors"),
    ).where(usage.c.at >= start, usage.c.at < end)
    if key is not None:
        query = query.where(usage.c.key_name == key)
    if model is not None:
        query = query.where(usage.c.model == model)
    if group_by:
        query = query.group_by(*(GROUPS[name] for name in group_by)).order_by(*(GROUPS[n] for n in group_by))
    async with engine.connect() as conn:
        result = await conn.execute(query)
        return [{name: row._mapping[name] for name in [*group_by, *SUMS]} for row in result]


async def tokens_used_since(engine: AsyncEngine, day: str, month_start: str) -> dict[str, tuple[int, int]]:
    """Per key: tokens used on `day` and since `month_start` (both "YYYY-MM-DD"): what a per-replica limiter
    starts its budgets from."""
    total = usage.c.prompt_tokens + usage.c.completion_tokens
    query = sa.select(
        usage.c.key_name,
        sa.func.coalesce(sa.func.sum(sa.case((usage.c.day == day, total), else_=0)), 0),
        sa.func.coalesce(sa.func.sum(total), 0),
    ).where(usage.c.day >= month_start, usage.c.key_name.is_not(None)).group_by(usage.c.key_name)
    async with engine.connect() as conn:
        return {name: (int(today), int(month)) for name, today, month in await conn.execute(query)}


def as_csv(rows: list[dict[str, Any]], group_by: list[str]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[*group_by, *SUMS], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
