"""What both front doors do with backends: tokenize, start (with fallback tiers), relay, aggregate, merge."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from backends.base import (
    Backend,
    BackendError,
    GenerationRequest,
    TokenEvent,
    TokenLogprob,
    ToolCall,
    UpstreamError,
    Usage,
    describe,
)
from gateway.closing import close_detached, detached
from gateway.errors import GatewayError
from gateway.policy.auth import current_principal
from gateway.routing.router import ModelRoute
from gateway.routing.shadow import tap
from gateway.store.limits import Reservation
from gateway.telemetry.record import RequestRecord, current_record
from gateway.tools.calls import ToolCallAccumulator

if TYPE_CHECKING:
    from gateway.state import Gateway

log = logging.getLogger("llmgw")
T = TypeVar("T")


async def tokenize_prompt(route: ModelRoute, text: str, add_special_tokens: bool = True) -> list[int] | None:
    """Token ids of a prompt, or None when the backend cannot tokenize: the upstream then checks limits."""
    if not route.backend.info().can_tokenize:
        return None
    try:
        spans = await route.backend.tokenize(text, add_special_tokens=add_special_tokens)  # type: ignore[call-arg]
    except BackendError as exc:  # e.g. a TGI too old for /tokenize: generation can still go ahead
        log.warning("backend %s could not tokenize; limits are left to the upstream: %s", route.backend_name, exc)
        return None
    return [s.id for s in spans]


@dataclass
class Served:
    backend: str  # the backend that answered (x-backend)
    events: AsyncIterator[TokenEvent]  # its whole stream, first event included


async def start(gw: Gateway, route: ModelRoute, request: GenerationRequest) -> Served:
    """Send the request to the route's first tier; when it fails before its first token (cannot
    connect, 5xx, 429, first-token timeout) retry it up to `retries` times with backoff, then go on
    to the next tier. The stream returned has its first token in hand: after that nothing is
    retried, and a failure ends it with a typed error. The API key's limits are reserved first, and
    settled when the stream ends (to nothing, if it never starts)."""
    reservation = await gw.accounts.quota.reserve(current_principal.get(), request)
    try:
        return await _start(gw, route, request, reservation)
    except GatewayError as exc:
        gw.accounts.quota.settle(reservation, 0)
        if (rec := current_record.get()) is not None:
            rec.error_kind = exc.kind
        raise
    except BaseException:
        gw.accounts.quota.settle(reservation, 0)
        raise


async def _start(gw: Gateway, route: ModelRoute, request: GenerationRequest, reservation: Reservation | None) -> Served:
    sent = time.perf_counter()
    rec = current_record.get()
    if route.adapter is not None and request.adapter is None:  # chosen by the door (OpenAI model, TGI adapter_id)
        request = msgspec.structs.replace(request, adapter=route.adapter)
    if rec is not None and request.adapter is not None:
        rec.adapter = request.adapter
    names = [name for name, _ in route.tiers]
    if rec is not None and not rec.routed_backend:
        rec.model, rec.routed_backend = route.name, names[0]
    timeout = route.config.request_timeout
    deadline = asyncio.get_running_loop().time() + timeout if timeout else None
    gw.tracing.routed(rec, route.name, names, request)
    last: BackendError | None = None
    for tier, (name, backend) in enumerate(route.tiers):
        for attempt in range(1 + route.config.retries):
            if attempt:
                gw.metrics.retries.labels(route.name, name).inc()
                await asyncio.sleep(backoff(route.config.retry_backoff, attempt))
            span, sent_request = gw.tracing.backend_call(rec, name, request)
            sent_ns = time.time_ns()
            gw.acquire(backend)
            stream = backend.generate(sent_request).__aiter__()
            try:
                async with asyncio.timeout_at(deadline):
                    first = await stream.__anext__()
            except StopAsyncIteration:
                error: BackendError = UpstreamError(f"{name}: the stream ended before any token")
            except BackendError as exc:
                error = exc
            except BaseException as exc:  # cancelled (the client left), out of time, or a backend bug
                gw.release(backend)
                gw.tracing.end_backend_call(span, sent_ns, None, None, "cancelled")
                await close_detached(stream)
                if isinstance(exc, TimeoutError):
                    raise _timed_out(timeout) from None
                raise
            else:
                gw.health.record_success(name)
                relayed = _relay(gw, name, backend, first, stream, deadline, timeout)
                events = _observe(gw, rec, reservation, request.max_new_tokens, route.name, name, relayed, span,
                                  sent_ns)
                if route.shadow is not None:
                    pair = gw.shadows.mirror(route.name, name, route.shadow, route.shadow_limit, request,
                                             route.shadow_topk)
                    if pair is not None:
                        events = tap(events, pair, sent)
                return Served(name, events)
            gw.release(backend)
            gw.metrics.upstream_errors.labels(name, error.kind).inc()
            gw.tracing.end_backend_call(span, sent_ns, None, None, error.kind)
            await close_detached(stream)
            if not error.retriable:
                raise GatewayError.from_backend(error) from None
            if gw.started.get(id(backend)):  # a backend still loading is not failing: no ejection for it
                gw.health.record_failure(name)
            last = error
            log.warning("backend %s failed before the first token (attempt %d): %s", name, attempt + 1, error)
        if tier + 1 < len(route.tiers):
            gw.metrics.fallbacks.labels(route.name, name, names[tier + 1]).inc()
            log.warning("backend %s failed; trying %s", name, names[tier + 1])
    assert last is not None
    raise GatewayError.from_backend(last) from None


def backoff(base: float, attempt: int, cap: float = 5.0) -> float:
    """Exponential backoff with full jitter (AWS's): uniform in [0, min(cap, base * 2^attempt))."""
    return random.uniform(0.0, min(cap, base * 2 ** attempt))


def _timed_out(timeout: float | None) -> GatewayError:
    return GatewayError(f"the request took longer than its {timeout:g} s limit (request_timeout)", kind="timeout")


async def _observe(gw: Gateway, rec: RequestRecord | None, reservation: Reservation | None, max_new_tokens: int,
                   model: str, backend: str, events: AsyncIterator[TokenEvent], span: Any,
                   sent_ns: int) -> AsyncIterator[TokenEvent]:
    """Note what the metrics, access log, usage record, trace and the key's limits need as the events pass."""
    itl = gw.metrics.child(gw.metrics.itl, model, backend)
    log_text = gw.config.server.log_text or (gw.config.state is not None and gw.config.state.log_content)
    first: TokenEvent | None = None
    first_ns: int | None = None
    previous = 0.0
    count = 0
    usage: Usage | None = None
    error: str | None = None
    if rec is not None:
        rec.model, rec.backend = model, backend
    try:
        async for event in events:
            now = time.perf_counter()
            if first is None:
                first, first_ns = event, time.time_ns()
                if rec is not None:
                    ttft = now - rec.started
                    rec.ttft = ttft if rec.ttft is None else min(rec.ttft, ttft)
                    rec.queue = event.queue_seconds
            else:
                itl.observe(now - previous)
            previous = now
            count += 1
            if event.finished:
                usage = event.usage
            if rec is not None:
                if log_text:
                    rec.output_text += event.text
                if event.finished:
                    rec.finish_reason = str(event.finish_reason)
                    final = event.usage_or_count(count)
                    rec.generated_tokens += final.completion_tokens
                    rec.prompt_tokens = max(rec.prompt_tokens, final.prompt_tokens)
                    rec.cached_tokens = max(rec.cached_tokens, final.cached_tokens)
            yield event
    except GatewayError as exc:
        error = exc.kind
        gw.metrics.upstream_errors.labels(backend, exc.kind).inc()
        if rec is not None:
            rec.error, rec.error_kind = exc.message, exc.kind
        raise
    finally:
        await close_detached(events)  # an `async for` left early does not close what it iterates
        gw.tracing.end_backend_call(span, sent_ns, first, first_ns, error)
        if reservation is not None:  # without a usage: what it generated, and its prompt as reserved
            gw.accounts.quota.settle(reservation, usage.total_tokens if usage else
                            count + reservation.amount - max_new_tokens)


async def _relay(gw: Gateway, name: str, backend: Backend, first: TokenEvent, stream: AsyncIterator[TokenEvent],
                 deadline: float | None, timeout: float | None) -> AsyncIterator[TokenEvent]:
    """The stream after its first token, errors typed for the front doors; ends with one finished event."""
    finished = first.finished
    try:
        yield first
        while not finished:
            try:
                if deadline is None:  # the common case: no timer per token
                    event = await stream.__anext__()
                else:
                    async with asyncio.timeout_at(deadline):
                        event = await stream.__anext__()
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise _timed_out(timeout) from None
            finished = event.finished
            yield event
    except BackendError as exc:
        if exc.retriable:
            gw.health.record_failure(name)
        raise GatewayError.from_backend(exc) from None
    except (GatewayError, GeneratorExit, asyncio.CancelledError):
        raise
    except Exception as exc:  # a backend bug must still end as one typed error, never a traceback
        raise GatewayError(describe(exc), kind="upstream") from None
    finally:
        gw.release(backend)
        closing = time.perf_counter()
        await close_detached(stream)  # closes the upstream request, or aborts the engine's
        if not finished and getattr(backend, "engine", None) is None:  # the engine reports its own aborts
            gw.metrics.abort_seconds.labels(name).observe(time.perf_counter() - closing)
    if not finished:
        raise GatewayError("Incomplete generation stream", kind="upstream")


Wrap = Callable[[AsyncIterator[TokenEvent]], AsyncIterator[TokenEvent]]


async def generate_whole(gw: Gateway, route: ModelRoute, request: GenerationRequest,
                         wrap: Wrap | None = None) -> Collected:
    """The whole answer; `wrap` rewrites the events first (the gateway's tool-call parser)."""
    served = await start(gw, route, request)
    result = await collect(wrap(served.events) if wrap is not None else served.events)
    result.backend = served.backend
    return result


@dataclass
class Collected:
    events: list[TokenEvent] = field(default_factory=list)
    text: str = ""
    token_text: str = ""
    backend: str = ""
    calls: ToolCallAccumulator = field(default_factory=ToolCallAccumulator)

    @property
    def last(self) -> TokenEvent:
        return self.events[-1]

    @property
    def usage(self) -> Usage:
        return self.last.usage_or_count(len(self.events))

    @property
    def prompt_tokens(self) -> list[TokenLogprob] | None:
        return self.events[0].prompt_tokens if self.events else None

    @property
    def sum_logprob(self) -> float:
        return sum(e.logprob or 0.0 for e in self.events)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.calls.calls()


async def collect(stream: AsyncIterator[TokenEvent]) -> Collected:
    result = Collected()
    async for event in stream:
        result.events.append(event)
        result.text += event.text
        if event.tool_calls:
            result.calls.add(event.tool_calls)
        if not event.special:
            result.token_text += event.token_text
    return result


async def gather_all(coros: list[Awaitable[T]]) -> list[T]:
    """All results, or the first failure with the others cancelled (freeing what they hold)."""
    if len(coros) == 1:
        return [await coros[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]  # type: ignore[arg-type]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [t.result() for t in tasks]


async def start_all(gw: Gateway, route: ModelRoute, requests: list[GenerationRequest]) -> list[Served]:
    """Start n copies (OpenAI `n`); if one cannot start, close the ones that did."""
    served: list[Served] = []
    try:
        for request in requests:
            served.append(await start(gw, route, request))
    except BaseException:
        for s in served:
            await close_detached(s.events)
        raise
    return served


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) answer was ready."""


async def unless_disconnected(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Await `work` in this task, but cancel it (aborting the engine request or closing the upstream one) if
    the client hangs up first. The request body has been read, so the next ASGI message is a disconnect. One
    watcher task per request: `work` runs where it is awaited, not in a task of its own. The watcher is not
    cancelled when `work` ends: the server's receive says "disconnect" once the response is complete, and the
    watcher then ends by itself. (A cancelled watcher left its CancelledError, traceback and frames, with the
    request's objects, in a reference cycle: about 50 objects a request for the garbage collector.)"""
    current = asyncio.current_task()
    assert current is not None
    gone = done = False

    async def disconnected() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        if not done:
            gone = True
            current.cancel()

    detached(disconnected())
    try:
        return await work
    except asyncio.CancelledError:
        if gone and current.uncancel() == 0:  # our cancel, and nobody else's: the client left
            raise ClientGone from None
        raise
    finally:
        done = True


async def merge(streams: list[AsyncIterator[TokenEvent]]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """Interleave several streams as their events arrive; an error in one ends them all."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, TokenEvent | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[TokenEvent]) -> None:
        try:
            async for event in stream:
                await queue.put((index, event))
            await queue.put((index, None))
        except Exception as exc:
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
