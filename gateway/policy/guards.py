"""ASGI middleware that guards every request before routing: API keys, and clients that are too
big or too slow. Errors come in the protocol's own shape (OpenAI's under /v1/, TGI's elsewhere).

- Keys: when `[auth]` lists any, every route but /live, the admin routes (which take the admin key), the
  console's page and script (no data in them: it calls the admin routes with the admin key) and, unless
  protected by config, /health, /ping, /info, /docs and /metrics needs `Bearer <key>`.
- Body: read whole before the app sees it, within `server.body_timeout` seconds (else 408) and
  `server.max_body_bytes` (else 413), so a slow sender cannot hold a request open.
- Each response write must complete within `server.send_timeout` seconds: a client that stops
  reading is then treated as gone (the app sees a disconnect), so the request's resources are freed
  as for any disconnect and uvicorn closes the unfinished response.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import TYPE_CHECKING, Any

import msgspec

from gateway.errors import GatewayError
from gateway.policy.auth import bearer, current_principal
from gateway.policy.quota import request_counted
from gateway.telemetry.record import current_record

if TYPE_CHECKING:
    from gateway.state import Gateway

log = logging.getLogger("llmgw")
ALWAYS_OPEN = ("/live", "/console")
HEALTH_ROUTES = ("/health", "/ping", "/info", "/docs")
Scope = dict[str, Any]


async def _reply(scope: Scope, send: Any, err: GatewayError) -> None:
    args = err.response_args_for(scope["path"])
    body = msgspec.json.encode(args["content"])
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (args["headers"] or {}).items()]
    if err.kind == "unauthorized":
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": args["status_code"], "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class AuthMiddleware:
    def __init__(self, app: Any, gateway: Gateway) -> None:
        self.app, self.gateway = app, gateway

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        keys = self.gateway.keys
        path: str = scope["path"]
        if not keys.enabled or path.startswith(ALWAYS_OPEN) or path.startswith("/admin"):
            return await self.app(scope, receive, send)
        if path.startswith(HEALTH_ROUTES) and not keys.auth.protect_health:
            return await self.app(scope, receive, send)
        header = _header(scope, b"authorization")
        if header is None and (api_key := _header(scope, b"x-api-key")):  # Anthropic's clients send this
            header = f"Bearer {api_key}"
        if path == "/metrics":
            if not keys.auth.protect_metrics or self._is_admin(header):
                return await self.app(scope, receive, send)
        try:
            principal = keys.authenticate(header)
        except GatewayError as err:
            # a key made a moment ago on another front or replica: read the stored keys again, then decide
            if err.code != "invalid_api_key" or not await self.gateway.accounts.recheck():
                return await _reply(scope, send, err)
            try:
                principal = self.gateway.keys.authenticate(header)
            except GatewayError as again:
                return await _reply(scope, send, again)
        token = current_principal.set(principal)
        counted = request_counted.set([False])
        if (rec := current_record.get()) is not None:
            rec.key_name = principal.name
        try:
            await self.app(scope, receive, send)
        finally:
            request_counted.reset(counted)
            current_principal.reset(token)

    def _is_admin(self, header: str | None) -> bool:
        admin = self.gateway.config.server.resolved_admin_key()
        presented = bearer(header)
        return bool(admin and presented and hmac.compare_digest(presented.encode(), admin.encode()))


class ClientLimitsMiddleware:
    def __init__(self, app: Any, gateway: Gateway) -> None:
        self.app, self.gateway = app, gateway

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        server = self.gateway.config.server
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > server.max_body_bytes:
            return await _reply(scope, send, _too_large(server.max_body_bytes))
        body = bytearray()
        try:
            async with asyncio.timeout(server.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # gone before its request was complete: nothing to answer
                    body += message.get("body", b"")
                    if len(body) > server.max_body_bytes:
                        return await _reply(scope, send, _too_large(server.max_body_bytes))
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            log.warning("%s %s: request body not received within %g s", scope["method"], scope["path"],
                        server.body_timeout)
            return await _reply(scope, send, GatewayError(
                f"the request body did not arrive within {server.body_timeout:g} s", kind="request_timeout"))
        pending = [{"type": "http.request", "body": bytes(body), "more_body": False}]
        stalled = asyncio.Event()  # set when a write to the client timed out
        listening: set[asyncio.Task[Any]] = set()  # tasks waiting in replay() for the client's next message

        async def replay() -> dict[str, Any]:
            if pending:
                return pending.pop()
            if stalled.is_set():
                return {"type": "http.disconnect"}
            # whichever comes first: the client's own message, or our verdict that it stopped reading (which
            # cancels this wait: no extra tasks per request for the race)
            me = asyncio.current_task()
            assert me is not None
            listening.add(me)
            try:
                return await receive()
            except asyncio.CancelledError:
                if stalled.is_set() and me.uncancel() == 0:
                    return {"type": "http.disconnect"}
                raise
            finally:
                listening.discard(me)

        async def send_in_time(message: dict[str, Any]) -> None:
            if stalled.is_set():
                return  # the connection is being given up; nothing more is sent
            try:
                async with asyncio.timeout(server.send_timeout):
                    await send(message)
            except TimeoutError:
                # Treated as a disconnect: the app's disconnect listener cancels the response, which closes
                # the body generator (releasing its admission, aborting the engine or upstream request).
                log.warning("%s %s: client stopped reading for %g s; dropping it", scope["method"], scope["path"],
                            server.send_timeout)
                stalled.set()
                for task in listening:
                    task.cancel()

        await self.app(scope, replay, send_in_time)


def _too_large(limit: int) -> GatewayError:
    return GatewayError(f"request body larger than {limit} bytes", kind="payload_too_large")
