"""Key and usage admin routes (behind the admin key): `/admin/keys` and `/admin/usage`.

Stored keys are managed here; config keys are listed (source "config") but change only in config.toml.
A change is live on this replica when its answer arrives (the snapshot is refreshed before answering)
and on the others within `[state] key_refresh_interval` (at once on Postgres, which notifies them).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

import msgspec
from litestar import Controller, Request, Response, delete, get, patch, post
from litestar.params import Parameter

from gateway.errors import GatewayError
from gateway.policy.auth import Principal
from gateway.protocol.keys import KeyCreate, KeyList, KeyRotate, KeyUpdate, KeyView
from gateway.routes.admin import require_admin
from gateway.state import Gateway
from gateway.store.keys import NameTaken, StoredKey
from gateway.store.state_store import StateStore
from gateway.store.usage_report import GROUPS, as_csv, usage_summary

T = TypeVar("T")
KeyId = Annotated[str, Parameter(pattern=r"^key_[0-9a-f]{24}$", description="A stored key's id")]


def _iso(seconds: float | None) -> str | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _view(key: StoredKey, secret: str | None = None) -> KeyView:
    return KeyView(id=key.id, name=key.name, source="store", models=key.models, rpm=key.rpm, tpm=key.tpm,
                   max_tokens_per_day=key.max_tokens_per_day, max_tokens_per_month=key.max_tokens_per_month,
                   expires_at=_iso(key.expires_at), metadata=key.metadata, created_at=_iso(key.created_at),
                   updated_at=_iso(key.updated_at), revoked_at=_iso(key.revoked_at),
                   secret_hint="..." + key.secret_hint, previous_secret_expires_at=_iso(key.previous_expires_at),
                   key=secret)


def _config_view(p: Principal) -> KeyView:
    limits = p.limits
    return KeyView(id=f"config:{p.name}", name=p.name, source="config", models=sorted(p.models), rpm=limits.rpm,
                   tpm=limits.tpm, max_tokens_per_day=limits.tokens_per_day,
                   max_tokens_per_month=limits.tokens_per_month, expires_at=None, metadata={}, created_at=None,
                   updated_at=None, revoked_at=None, secret_hint=None, previous_secret_expires_at=None)


def _store(gw: Gateway, request: Request) -> StateStore:
    require_admin(gw, request)
    store = gw.accounts.store
    if store is None:
        raise GatewayError("keys and usage are kept only with a state database: add a [state] table to the config",
                           status=404, code="no_state_store")
    return store


async def _body(request: Request, cls: type[T]) -> T:
    try:
        return msgspec.json.decode(await request.body(), type=cls, strict=True)
    except msgspec.ValidationError as exc:
        raise GatewayError(f"invalid body: {exc}", status=400) from None
    except msgspec.DecodeError as exc:
        raise GatewayError(f"the body is not valid JSON: {exc}", status=400) from None


def _check_models(gw: Gateway, models: list[str] | msgspec.UnsetType) -> None:
    for i, name in enumerate(models or []):
        if gw.config.resolve_model(name) is None:
            raise GatewayError(f"models[{i}]: no model named {name!r}", status=400, param=f"models[{i}]")


def _check_name(gw: Gateway, name: str | msgspec.UnsetType) -> None:
    if isinstance(name, str) and any(key.name == name for key in gw.config.auth.keys):
        raise GatewayError(f"a config key is named {name!r}", status=409, code="name_taken")


async def _call(store: StateStore, operation: Any) -> Any:
    """Run a store operation: its answer, with the snapshot refreshed; 409 for a name in use, 503 when down."""
    try:
        result = await operation
    except NameTaken as exc:
        raise GatewayError(str(exc), status=409, code="name_taken") from None
    except Exception as exc:
        raise GatewayError(f"the state database cannot be reached ({type(exc).__name__})", kind="unavailable") from None
    await store.snapshot.refresh()
    return result


def _found(key: Any, key_id: str) -> Any:
    if key is None:
        raise GatewayError(f"no key with id {key_id!r} (or it is revoked)", status=404, code="key_not_found")
    return key


class KeysAdminController(Controller):
    path = "/admin"
    tags = ["Admin"]

    @post("/keys", summary="Create an API key (its secret is in this answer only)", operation_id="create_key",
          status_code=201)
    async def create(self, gateway: Gateway, request: Request) -> KeyView:
        store = _store(gateway, request)
        body = await _body(request, KeyCreate)
        _check_models(gateway, body.models)
        _check_name(gateway, body.name)
        key, secret = await _call(store, store.keys.create(body))
        return _view(key, secret)

    @get("/keys", summary="Stored and config API keys", operation_id="list_keys")
    async def list_keys(self, gateway: Gateway, request: Request, include_revoked: bool = False) -> KeyList:
        store = _store(gateway, request)
        stored = await _call(store, store.keys.list(include_revoked))
        config = [_config_view(p) for p in gateway.keys.principals() if p.key_id is None]
        return KeyList(data=[*config, *(_view(k) for k in stored)])

    @get("/keys/{key_id:str}", summary="One stored API key", operation_id="get_key")
    async def show(self, gateway: Gateway, request: Request, key_id: KeyId) -> KeyView:
        store = _store(gateway, request)
        return _view(_found(await _call(store, store.keys.get(key_id)), key_id))

    @patch("/keys/{key_id:str}", summary="Change a stored API key (null clears a limit)", operation_id="update_key")
    async def update(self, gateway: Gateway, request: Request, key_id: KeyId) -> KeyView:
        store = _store(gateway, request)
        body = await _body(request, KeyUpdate)
        _check_models(gateway, body.models)
        _check_name(gateway, body.name)
        return _view(_found(await _call(store, store.keys.update(key_id, body)), key_id))

    @delete("/keys/{key_id:str}", summary="Revoke a stored API key", operation_id="revoke_key", status_code=200)
    async def revoke(self, gateway: Gateway, request: Request, key_id: KeyId) -> KeyView:
        store = _store(gateway, request)
        return _view(_found(await _call(store, store.keys.revoke(key_id)), key_id))

    @post("/keys/{key_id:str}/rotate", summary="New secret; the old one works for grace_seconds more",
          operation_id="rotate_key", status_code=200)
    async def rotate(self, gateway: Gateway, request: Request, key_id: KeyId) -> KeyView:
        store = _store(gateway, request)
        body = await _body(request, KeyRotate) if await request.body() else KeyRotate()
        key, secret = _found(await _call(store, store.keys.rotate(key_id, body.grace_seconds)), key_id)
        return _view(key, secret)

    @get("/usage", summary="Usage summed by key, model, backend and day (JSON, or CSV with format=csv)",
         operation_id="usage_report")
    async def usage(self, gateway: Gateway, request: Request, start: str | None = None, end: str | None = None,
                    group_by: str = "key,model,day", key: str | None = None, model: str | None = None,
                    format: str = "json") -> Response:
        store = _store(gateway, request)
        groups = [g.strip() for g in group_by.split(",") if g.strip()]
        for g in groups:
            if g not in GROUPS:
                raise GatewayError(f"group_by: unknown group {g!r} (known: {', '.join(GROUPS)})", status=400,
                                   param="group_by")
        if format not in ("json", "csv"):
            raise GatewayError("format: json or csv", status=400, param="format")
        now = time.time()
        since, until = _when(start, "start", now - 30 * 86400), _when(end, "end", now + 1)
        if store.usage is not None:
            await store.usage.flush()  # what this replica has buffered counts too
        rows = await _call(store, usage_summary(store.engine, since, until, groups, key, model))
        if format == "csv":
            return Response(as_csv(rows, groups), media_type="text/csv; charset=utf-8")
        return Response({"start": _iso(since), "end": _iso(until), "group_by": groups, "data": rows})


def _when(value: str | None, name: str, default: float) -> float:
    """A time given as RFC 3339 / ISO 8601 (a date alone is its UTC midnight) or Unix seconds."""
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise GatewayError(f"{name}: expected an ISO 8601 time or Unix seconds, got {value!r}", status=400,
                           param=name) from None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()
