"""What both front doors do with a backend stream: tokenize, run, aggregate, merge."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from backends.base import BackendError, GenerationRequest, TokenEvent, TokenLogprob, Usage, describe
from gateway.errors import GatewayError
from gateway.router import ModelRoute

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


async def run_stream(route: ModelRoute, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
    """The backend's events, with its errors typed for the front doors; ends with one finished event."""
    finished = False
    try:
        async for event in route.backend.generate(request):
            yield event
            if event.finished:
                finished = True
                return
    except BackendError as exc:
        raise GatewayError.from_backend(exc) from None
    except GatewayError:
        raise
    except Exception as exc:  # a backend bug must still end as one typed error, never a traceback
        raise GatewayError(describe(exc), kind="upstream") from None
    if not finished:
        raise GatewayError("Incomplete generation stream", kind="upstream")


@dataclass
class Collected:
    events: list[TokenEvent] = field(default_factory=list)
    text: str = ""
    token_text: str = ""

    @property
    def last(self) -> TokenEvent:
        return self.events[-1]

    @property
    def usage(self) -> Usage:
        return self.last.usage or Usage(0, len(self.events))

    @property
    def prompt_tokens(self) -> list[TokenLogprob] | None:
        return self.events[0].prompt_tokens if self.events else None

    @property
    def sum_logprob(self) -> float:
        return sum(e.logprob or 0.0 for e in self.events)


async def collect(stream: AsyncIterator[TokenEvent]) -> Collected:
    result = Collected()
    async for event in stream:
        result.events.append(event)
        result.text += event.text
        if not event.special:
            result.token_text += event.token_text
    return result


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) answer was ready."""


async def unless_disconnected(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (aborting the engine request or closing the upstream one) if the
    client hangs up first. The request body has been read, so the next ASGI message is a disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone


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
