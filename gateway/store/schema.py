"""The tables, in SQLAlchemy Core. A change here needs an Alembic revision in migrations/versions/."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()
# times are Unix seconds (UTC): the same arithmetic on SQLite and Postgres; usage rows also carry their UTC day
Timestamp = sa.Float(precision=53)

api_keys = sa.Table(
    "api_keys", metadata,
    sa.Column("id", sa.String(40), primary_key=True),  # "key_<hex>": what the admin API and CLI name it by
    sa.Column("name", sa.String(200), nullable=False, index=True),  # unique among live keys; in usage rows
    sa.Column("secret_hash", sa.String(64), nullable=False, unique=True),  # SHA-256 hex of the secret
    sa.Column("secret_hint", sa.String(16), nullable=False),  # the secret's last characters, to tell keys apart
    sa.Column("previous_hash", sa.String(64), nullable=True),  # the secret before a rotation...
    sa.Column("previous_expires_at", Timestamp, nullable=True),  # ...valid until then
    sa.Column("models", sa.JSON, nullable=False),  # allowed model names; [] = all
    sa.Column("rpm", sa.Integer, nullable=True),
    sa.Column("tpm", sa.Integer, nullable=True),
    sa.Column("max_tokens_per_day", sa.BigInteger, nullable=True),
    sa.Column("max_tokens_per_month", sa.BigInteger, nullable=True),
    sa.Column("expires_at", Timestamp, nullable=True),
    sa.Column("metadata", sa.JSON, nullable=False),  # team, owner, anything the platform team tracks
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("updated_at", Timestamp, nullable=False),
    sa.Column("revoked_at", Timestamp, nullable=True),
)

usage = sa.Table(
    "usage", metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("at", Timestamp, nullable=False),  # when the request ended
    sa.Column("day", sa.String(10), nullable=False),  # its UTC date, "2026-12-04": what reports group by
    sa.Column("request_id", sa.String(128), nullable=False),
    sa.Column("key_name", sa.String(200), nullable=True),  # None: the gateway has no keys
    sa.Column("model", sa.String(200), nullable=True),
    sa.Column("backend", sa.String(200), nullable=True),
    sa.Column("route", sa.String(100), nullable=False),
    sa.Column("door", sa.String(20), nullable=False),  # openai, anthropic, tgi, responses
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("cached_tokens", sa.Integer, nullable=False),
    sa.Column("ttft_ms", sa.Float, nullable=True),
    sa.Column("duration_ms", sa.Float, nullable=False),
    sa.Column("status", sa.Integer, nullable=False),
    sa.Column("finish_reason", sa.String(40), nullable=True),
    sa.Column("prompt_text", sa.Text, nullable=True),  # only with [state] log_content = true
    sa.Column("output_text", sa.Text, nullable=True),
    sa.Index("ix_usage_at", "at"),
    sa.Index("ix_usage_key_day", "key_name", "day"),
)

responses = sa.Table(
    "responses", metadata,
    sa.Column("id", sa.String(100), primary_key=True),
    sa.Column("owner", sa.String(200), nullable=True),  # the API key's name; None when the gateway has no keys
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("expires_at", Timestamp, nullable=False),
    sa.Column("body", sa.LargeBinary, nullable=False),  # msgspec JSON: the response object and its conversation
    sa.Index("ix_responses_expires_at", "expires_at"),
)

# staged rollouts (gateway/rollout/): one row per model, the decisions appended, each replica's window of the
# current step, and the leader's lease
rollouts = sa.Table(
    "rollouts", metadata,
    sa.Column("model", sa.String(200), primary_key=True),
    sa.Column("version", sa.Integer, nullable=False),  # bumped by every write: writers compare and swap
    sa.Column("doc", sa.JSON, nullable=False),  # the spec, state, step, epoch, last gate results
    sa.Column("updated_at", Timestamp, nullable=False),
)

rollout_decisions = sa.Table(
    "rollout_decisions", metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("model", sa.String(200), nullable=False, index=True),
    sa.Column("at", Timestamp, nullable=False),
    sa.Column("doc", sa.JSON, nullable=False),  # action, step, weight, reason, by, the gates' figures
)

rollout_windows = sa.Table(
    "rollout_windows", metadata,
    sa.Column("model", sa.String(200), primary_key=True),
    sa.Column("replica", sa.String(200), primary_key=True),
    sa.Column("epoch", sa.Integer, nullable=False),  # the step it belongs to (rollouts.doc.epoch)
    sa.Column("doc", sa.JSON, nullable=False),
    sa.Column("updated_at", Timestamp, nullable=False),
)

leases = sa.Table(
    "leases", metadata,
    sa.Column("name", sa.String(100), primary_key=True),
    sa.Column("holder", sa.String(200), nullable=False),
    sa.Column("expires_at", Timestamp, nullable=False),
)
