"""Wire types of the key and usage admin routes (`/admin/keys`, `/admin/usage`)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import msgspec

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:@/-]*$")]
Limit = Annotated[int, msgspec.Meta(ge=1, le=2**53)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=10 * 365 * 86400)]
Metadata = Annotated[dict[str, Any], msgspec.Meta(max_length=64)]


class KeyCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Name  # unique; what logs, metrics and usage rows show
    models: list[str] = []  # models (or aliases) it may use; empty: all
    rpm: Limit | None = None  # requests per minute
    tpm: Limit | None = None  # prompt + completion tokens per minute
    max_tokens_per_day: Limit | None = None  # UTC day
    max_tokens_per_month: Limit | None = None  # UTC month
    expires_at: datetime | None = None  # RFC 3339, with a time zone
    metadata: Metadata = {}  # team, owner, ...


class KeyUpdate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """PATCH: a field left out stays; null clears a limit or the expiry."""

    name: Name | msgspec.UnsetType = msgspec.UNSET
    models: list[str] | msgspec.UnsetType = msgspec.UNSET
    rpm: Limit | None | msgspec.UnsetType = msgspec.UNSET
    tpm: Limit | None | msgspec.UnsetType = msgspec.UNSET
    max_tokens_per_day: Limit | None | msgspec.UnsetType = msgspec.UNSET
    max_tokens_per_month: Limit | None | msgspec.UnsetType = msgspec.UNSET
    expires_at: datetime | None | msgspec.UnsetType = msgspec.UNSET
    metadata: Metadata | msgspec.UnsetType = msgspec.UNSET


class KeyRotate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    grace_seconds: Seconds = 3600.0  # how long the old secret keeps working


class KeyView(msgspec.Struct, kw_only=True, omit_defaults=False):
    id: str
    name: str
    source: str  # "store" (managed here) or "config" (config.toml; read-only)
    models: list[str]
    rpm: int | None
    tpm: int | None
    max_tokens_per_day: int | None
    max_tokens_per_month: int | None
    expires_at: str | None  # RFC 3339, UTC
    metadata: dict[str, Any]
    created_at: str | None
    updated_at: str | None
    revoked_at: str | None
    secret_hint: str | None  # "...a1b2": the secret's last characters
    previous_secret_expires_at: str | None  # after a rotation: until when the old secret works
    key: str | None = None  # the secret: only in the answer that created or rotated it


class KeyList(msgspec.Struct, kw_only=True):
    data: list[KeyView]
