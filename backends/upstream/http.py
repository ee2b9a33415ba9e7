"""What every HTTP backend shares: the pooled client, timeouts, event streams, error mapping."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec

from backends.base import (
    BackendError,
    BackendOverloadedError,
    BackendTimeoutError,
    BackendUnavailableError,
    BackendValidationError,
    GenerationRequest,
    UpstreamError,
)
from backends.pool.settings import PoolFields
from backends.upstream.client import ConnectError, UpstreamClient
from backends.upstream.sse import SSEEvent, iter_sse


class HttpSettings(PoolFields, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Connection settings common to every HTTP backend type; the pool fields make it many replicas."""

    type: str
    """The backend type's name (each type sets its own)."""
    base_url: str = ""
    """One server; or `endpoints`, or this with discovery = "dns" (the pool keys)."""
    api_key: str | None = None
    """Sent to the upstream as `Authorization: Bearer <key>`; None: no key."""
    api_key_env: str | None = None
    """Name of an environment variable holding the key (it wins over api_key when set)."""
    connect_timeout: float = 5.0
    """Seconds to connect to the upstream (and for each health check)."""
    first_token_timeout: float = 60.0
    """Seconds from the request sent to the first event."""
    idle_timeout: float = 30.0
    """Longest gap between two events, in seconds."""
    total_timeout: float = 600.0
    """Seconds for a whole upstream request."""
    max_connections: int = 100
    """Connections open to the upstream at once (in a pool: to each replica); idle ones are kept for reuse."""
    max_keepalive_connections: int = 20
    """Accepted for older configs; idle connections are kept up to max_connections (aiohttp's pool)."""

    def __post_init__(self) -> None:
        self.check_pool(self.base_url)

    def resolved_api_key(self) -> str | None:
        if self.api_key_env:
            return os.environ.get(self.api_key_env) or self.api_key
        return self.api_key


def make_client(settings: HttpSettings) -> UpstreamClient:
    """One pooled client per backend (or replica): aiohttp's pool, used directly (client.py)."""
    key = settings.resolved_api_key()
    return UpstreamClient(settings.base_url, {"Authorization": f"Bearer {key}"} if key else {},
                          settings.connect_timeout, settings.total_timeout, settings.max_connections)


async def get_json(client: UpstreamClient, path: str) -> Any:
    """A GET's JSON body when it answers 200 within the connect timeout, else None (an info probe)."""
    try:
        status, payload = await client.get_json(path)
    except (aiohttp.ClientError, TimeoutError):
        return None
    return payload if status == 200 else None


async def answers_ok(client: UpstreamClient, path: str, settings: HttpSettings) -> bool:
    """A health probe: GET `path` answers 200 within the connect timeout."""
    try:
        return (await client.get_json(path))[0] == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


def trace_headers(request: GenerationRequest) -> dict[str, str]:
    return {"traceparent": request.traceparent} if request.traceparent else {}


def error_message(body: bytes) -> str:
    """The message inside any upstream error shape: OpenAI nested, vLLM/trtllm flat, TGI, Triton, plain text."""
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.decode("utf-8", errors="replace").strip() or "(empty body)"
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict):
            return str(error.get("message") or error.get("detail") or error)
        if error is not None:
            return str(error)
        if "detail" in payload:
            return str(payload["detail"])
        if "message" in payload:
            return str(payload["message"])
    return str(payload)


def error_for_status(status: int, message: str, backend: str) -> BackendError:
    text = f"{backend}: upstream answered {status}: {message}"
    if status in (400, 413, 422):
        return BackendValidationError(message, status)
    if status == 429:
        return BackendOverloadedError(text, status)
    if status in (502, 503, 504):
        return BackendUnavailableError(text, status)
    return UpstreamError(text, status)


@asynccontextmanager
async def open_stream(client: UpstreamClient, backend: str, path: str, body: dict[str, Any],
                      headers: dict[str, str]) -> AsyncIterator[aiohttp.ClientResponse]:
    """POST and yield the response once its status is 200; any other status becomes a typed error."""
    try:
        async with client.post(path, msgspec.json.encode(body),
                               {"content-type": "application/json", **headers}) as response:
            if response.status != 200:
                raise error_for_status(response.status, error_message(await response.read()), backend)
            yield response
    except ConnectError as exc:
        raise BackendUnavailableError(f"{backend}: cannot connect: {exc}") from None
    except TimeoutError as exc:
        raise BackendTimeoutError(f"{backend}: upstream timed out ({type(exc).__name__})") from None
    except aiohttp.ClientError as exc:
        raise UpstreamError(f"{backend}: {type(exc).__name__}: {exc}") from None


async def timed_events(response: aiohttp.ClientResponse, settings: HttpSettings, backend: str,
                       started: float) -> AsyncIterator[SSEEvent]:
    """The response's SSE events, failing on the first-token, idle and total timeouts.

    The idle deadline runs from when the next event is wanted (keep-alive comments do not move it) but is only
    armed around a read from the socket: events already buffered pass without a timer (most of them, at speed)."""
    total_at = started + settings.total_timeout  # time.monotonic(), which is also the event loop's clock
    next_at = [min(started + settings.first_token_timeout, total_at)]  # the next event is due by then
    first = [True]

    async def chunks() -> AsyncIterator[bytes]:
        raw = response.content.iter_any().__aiter__()
        while True:
            try:
                async with asyncio.timeout_at(next_at[0]):
                    chunk = await raw.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                what = "total" if next_at[0] >= total_at else "first-token" if first[0] else "idle"
                limit = (settings.total_timeout if what == "total" else settings.first_token_timeout
                         if first[0] else settings.idle_timeout)
                raise BackendTimeoutError(f"{backend}: upstream {what} timeout "
                                          f"({limit:.1f} s without an event)") from None
            except aiohttp.ClientError as exc:
                raise UpstreamError(f"{backend}: stream broken: {type(exc).__name__}: {exc}") from None
            yield chunk

    events = iter_sse(chunks())
    try:
        async for event in events:
            first[0] = False
            yield event
            next_at[0] = min(time.monotonic() + settings.idle_timeout, total_at)  # from when the next is wanted
    finally:
        await events.aclose()


async def drain(events: AsyncIterator[SSEEvent], seconds: float = 1.0) -> None:
    """Read what follows `[DONE]` (normally nothing) so the connection goes back to the pool."""
    try:
        async with asyncio.timeout(seconds):
            async for _ in events:
                pass
    except (TimeoutError, BackendError):
        pass


async def read_body(response: aiohttp.ClientResponse, settings: HttpSettings, backend: str) -> bytes:
    """A whole (non-streamed) body within the first-token timeout."""
    try:
        async with asyncio.timeout(settings.first_token_timeout):
            return await response.read()
    except TimeoutError:
        raise BackendTimeoutError(f"{backend}: upstream first-token timeout "
                                  f"({settings.first_token_timeout:.1f} s without an answer)") from None
    except aiohttp.ClientError as exc:
        raise UpstreamError(f"{backend}: answer broken: {type(exc).__name__}: {exc}") from None


def drop_none(body: dict[str, Any]) -> dict[str, Any]:
    """Upstreams differ on null (Triton refuses it, trtllm-serve validates it): never send one."""
    return {k: v for k, v in body.items() if v is not None}
