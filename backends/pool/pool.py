"""A pool: one `Backend` made of N replica backends of one type, with a balancer in front.

The gateway sees one backend (one name in routes, fallback, shadow, sticky sessions); inside, each
request goes to the replica the policy picks (`balance.py`). Per replica the pool keeps in-flight
requests and outstanding tokens, health (active checks run when the gateway checks the pool, passive
ejection after consecutive failures), scraped load figures (`signals.py`), and, with DNS discovery,
membership. A replica that cannot be reached before the first token is ejected after
`eject_after_failures` and the request moves to another replica; the pool fails only when none answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, ClassVar, Protocol
from urllib.parse import urlsplit

import msgspec

from backends.base import (
    Backend,
    BackendError,
    BackendInfo,
    BackendUnavailableError,
    BackendValidationError,
    GenerationRequest,
    TokenEvent,
    TokenSpan,
    describe,
)
from backends.pool.balance import Choice, Policy, PrefixAware, make_policy
from backends.pool.discovery import Resolver, discover, resolve_host
from backends.pool.prefix_index import prompt_tokens, request_block_hashes
from backends.pool.replica import HealthNews, Replica
from backends.pool.settings import PoolFields
from backends.pool.signals import Scraper

log = logging.getLogger("llmgw")
POOL_DEFAULTS = {f.name: f.default_factory() if f.default is msgspec.NODEFAULT else f.default
                 for f in msgspec.structs.fields(PoolFields)}


class PoolObserver(Protocol):
    """What the gateway's telemetry hears from a pool (per replica metrics, the access log)."""

    def chosen(self, pool: str, replica: str, reason: str) -> None: ...

    def first_token(self, pool: str, replica: str, seconds: float) -> None: ...

    def failed(self, pool: str, replica: str, kind: str) -> None: ...

    def ejected(self, pool: str, replica: str) -> None: ...


def replica_settings(settings: Any, url: str) -> Any:
    """One replica's settings: the pool's, at one URL, with the pool fields at their defaults (so
    changing only the balancing leaves the replicas equal, and a reload keeps them)."""
    return msgspec.structs.replace(settings, **{**POOL_DEFAULTS, "base_url": url})


class PoolBackend:
    """A Backend over replicas made by `factory(replica_id)`: one per URL in `endpoints`, per
    address `base_url` resolves to (discovery = "dns"), or per id in `replica_ids` (worker processes)."""

    Settings: ClassVar[type[msgspec.Struct]] = PoolFields

    def __init__(self, name: str, settings: Any, factory: Callable[[str], Backend], type_name: str,
                 resolver: Resolver | None = None, replica_ids: Sequence[str] | None = None,
                 replica_source: Any = None) -> None:
        self.name = name
        self.type_name = type_name
        self.settings: PoolFields = settings
        self.replica_source = replica_source if replica_source is not None else settings  # what replicas are made of
        self.factory = factory
        self.resolver = resolver or resolve_host
        self.fixed_ids = list(replica_ids if replica_ids is not None else settings.endpoints)
        self.replicas: list[Replica] = []
        self.policy: Policy = make_policy(settings)
        self.observers: list[PoolObserver] = []
        self.health_listeners: list[Callable[[HealthNews], None]] = []  # ejections and check changes seen here
        self._template: Backend | None = None
        self._adoptable: dict[str, Replica] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._scraper = Scraper(name, settings)
        self._closed = False
        self._tokenize_turn = 0

    @classmethod
    def for_http(cls, name: str, settings: Any, backend_class: type[Backend],
                 resolver: Resolver | None = None) -> PoolBackend:
        return cls(name, settings, lambda url: backend_class(f"{name}@{urlsplit(url).netloc}",  # type: ignore[call-arg]
                                                             replica_settings(settings, url)),
                   backend_class.type_name, resolver)

    # lifecycle

    async def start(self) -> None:
        ids = self.fixed_ids
        if self.settings.discovery == "dns":
            ids = await self._resolve() or []
        await asyncio.gather(*(self._add(i) for i in ids))
        if self.settings.scrape_interval > 0:
            self._tasks.append(asyncio.create_task(self._scrape_loop()))
        if self.settings.discovery == "dns":
            self._tasks.append(asyncio.create_task(self._dns_loop()))

    async def _add(self, replica_id: str) -> Replica:
        replica = self._adoptable.pop(replica_id, None)
        if replica is not None:  # kept from the config before a reload: started, warm, with its history
            replica.owners += 1
            self.replicas.append(replica)
            return replica
        replica = Replica(replica_id, self.factory(replica_id))
        self.replicas.append(replica)
        try:
            await replica.backend.start()
            healthy = await replica.backend.health()
        except Exception as exc:
            log.error("backend %s: replica %s failed to start: %s", self.name, replica_id, describe(exc))
            healthy = False
        replica.started = True
        replica.record_check(healthy, self.name)
        return replica

    def carry_over(self, old: Any) -> None:
        """Before start(), on a reload: take over the replicas of `old` (the pool this one replaces)
        whose own settings did not change, and its prefix index when it keys blocks the same way."""
        if not isinstance(old, PoolBackend) or old.type_name != self.type_name:
            return
        for replica in old.replicas:
            if self.replica_key(replica.id) == old.replica_key(replica.id) and replica.started:
                self._adoptable[replica.id] = replica
        same_keys = all(getattr(self.settings, k) == getattr(old.settings, k) for k in
                        ("prefix_block_tokens", "prefix_block_chars", "prefix_max_blocks", "prefix_capacity"))
        if isinstance(self.policy, PrefixAware) and isinstance(old.policy, PrefixAware) and same_keys:
            self.policy.index = old.policy.index

    def replica_key(self, replica_id: str) -> Any:
        """What one replica is made of: equal keys, an interchangeable replica."""
        if isinstance(self.replica_source, PoolFields) and hasattr(self.replica_source, "base_url"):
            return replica_settings(self.replica_source, replica_id)  # an HTTP endpoint
        return self.replica_source  # e.g. an engine worker's settings

    async def aclose(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for replica in [*self.replicas, *self._adoptable.values()]:
            await self._release(replica, adopted=replica in self._adoptable.values())
        self.replicas = []
        self._adoptable = {}
        for closeable in (self._template, self._scraper):
            if closeable is not None:
                with contextlib.suppress(Exception):
                    await closeable.aclose()

    async def _release(self, replica: Replica, adopted: bool = False) -> None:
        if adopted:
            return  # never taken: still the old pool's alone
        replica.owners -= 1
        if replica.owners <= 0:
            with contextlib.suppress(Exception):
                await replica.backend.aclose()

    # the Backend protocol

    async def health(self) -> bool:
        """Checks every replica (the gateway calls this every health_check_interval); the pool is
        healthy while one replica is available."""
        started = [r for r in self.replicas if r.started]

        async def check(replica: Replica) -> None:
            healthy = False
            with contextlib.suppress(Exception):
                healthy = await replica.backend.health()
            was_failing = replica.check_failed
            replica.record_check(healthy, self.name)
            if replica.check_failed != was_failing:
                self._tell(HealthNews(replica.id, check_failed=replica.check_failed))

        await asyncio.gather(*(check(r) for r in started))
        return any(r.available() for r in self.replicas)

    def info(self) -> BackendInfo:
        for replica in self.replicas:
            if replica.started:
                return replica.backend.info()
        if self.replicas:
            return self.replicas[0].backend.info()
        if self._template is None:  # DNS found nothing yet: the settings still say what it will be
            self._template = self.factory(self.fixed_ids[0] if self.fixed_ids else self.settings.base_url)  # type: ignore[attr-defined]
        return self._template.info()

    def startup_step(self) -> str | None:
        """For /health while starting: the first replica that says what it is doing."""
        for replica in self.replicas:
            step = getattr(replica.backend, "startup_step", None)
            said = step() if callable(step) else None
            if said:
                return f"{replica.id}: {said}"
        return None

    # LoRA adapters: every replica serves the same ones

    def adapters(self) -> dict[str, Any]:
        replica = next((r for r in self.replicas if r.started), None) or (self.replicas[0] if self.replicas else None)
        listed = getattr(replica.backend, "adapters", None) if replica is not None else None
        return listed() if callable(listed) else {}

    async def load_adapter(self, name: str, path: str) -> None:
        """On every replica, or on none (the ones that took it unload it again)."""
        loaders = [getattr(r.backend, "load_adapter", None) for r in self.replicas]
        if not self.replicas or None in loaders:
            raise BackendValidationError(f"backend {self.name!r} ({self.type_name}) cannot load LoRA adapters at run "
                                         "time; list them in its `lora_adapters` in config")
        done: list[Replica] = []
        try:
            for replica in list(self.replicas):
                await replica.backend.load_adapter(name, path)  # type: ignore[attr-defined]
                done.append(replica)
        except BackendError:
            for replica in done:
                with contextlib.suppress(BackendError):
                    await replica.backend.unload_adapter(name)  # type: ignore[attr-defined]
            raise

    async def unload_adapter(self, name: str) -> None:
        for replica in list(self.replicas):
            unload = getattr(replica.backend, "unload_adapter", None)
            if unload is not None:
                await unload(name)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[TokenSpan]:
        available = self._candidates(set())
        self._tokenize_turn += 1  # in turn: tokenizing is work too
        replica = available[self._tokenize_turn % len(available)] if available else self._any()
        return await replica.backend.tokenize(text, add_special_tokens=add_special_tokens)  # type: ignore[call-arg]

    async def generate(self, request: GenerationRequest, choice: Choice | None = None,
                       served: list[Replica] | None = None) -> AsyncIterator[TokenEvent]:
        """The request on the replica the policy picks (or on `choice`, made by the caller), moved to another
        if one fails before its first event; `served` (when given) gets each replica tried, the last served."""
        hashes = request_block_hashes(request, self.settings.prefix_block_tokens, self.settings.prefix_block_chars,
                                      self.settings.prefix_max_blocks) if self.policy.uses_prefixes else []
        tried: set[str] = set()
        while True:
            choice = choice if choice is not None and not tried else self._choose(hashes, tried)
            replica = choice.replica
            tried.add(replica.id)
            if served is not None:
                served.append(replica)
            for observer in self.observers:
                observer.chosen(self.name, replica.id, choice.reason)
            budget = prompt_tokens(request) + request.max_new_tokens
            replica.in_flight += 1
            replica.outstanding_tokens += budget
            replica.requests += 1
            sent = time.perf_counter()
            counted = False  # this failure is already counted against the replica
            stream = replica.backend.generate(request).__aiter__()
            try:
                try:
                    first = await stream.__anext__()
                except StopAsyncIteration:
                    raise BackendUnavailableError(f"{replica.id}: the stream ended before any token") from None
                except BackendError as exc:
                    self._failed(replica, exc)
                    counted = True
                    if exc.retriable and self._candidates(tried):  # nothing was sent to the client yet
                        log.warning("backend %s: replica %s failed before the first token (%s); trying another",
                                    self.name, replica.id, exc.message)
                        continue
                    raise
                replica.record_success()
                for observer in self.observers:
                    observer.first_token(self.name, replica.id, time.perf_counter() - sent)
                event = first
                while True:
                    yield event
                    if budget > 0:  # one token less to come
                        budget -= 1
                        replica.outstanding_tokens -= 1
                    try:
                        event = await stream.__anext__()
                    except StopAsyncIteration:
                        return
            except BackendError as exc:
                if not counted:
                    self._failed(replica, exc)
                raise
            finally:
                replica.in_flight -= 1
                replica.outstanding_tokens -= budget
                with contextlib.suppress(Exception):
                    await stream.aclose()

    # choice

    def _candidates(self, tried: set[str]) -> list[Replica]:
        now = time.monotonic()
        return [r for r in self.replicas if r.id not in tried and r.available(now)]

    def _any(self) -> Replica:
        if not self.replicas:
            raise BackendUnavailableError(f"{self.name}: the pool has no replica"
                                          + (" (DNS found none)" if self.settings.discovery == "dns" else ""))
        return self.replicas[0]

    def choose(self, request: GenerationRequest) -> Choice:
        """The replica the policy would pick for `request` now (the caller then passes it to generate)."""
        hashes = request_block_hashes(request, self.settings.prefix_block_tokens, self.settings.prefix_block_chars,
                                      self.settings.prefix_max_blocks) if self.policy.uses_prefixes else []
        return self._choose(hashes, set())

    def _choose(self, hashes: list[int], tried: set[str]) -> Choice:
        candidates = self._candidates(tried)
        if not candidates:  # every replica ejected or failing: try them anyway rather than refuse outright
            candidates = [r for r in self.replicas if r.id not in tried and r.started] or [self._any()]
        return self.policy.choose(candidates, hashes)

    def _failed(self, replica: Replica, exc: BackendError) -> None:
        for observer in self.observers:
            observer.failed(self.name, replica.id, exc.kind)
        if not exc.retriable:
            return
        if replica.record_failure(self.settings.eject_after_failures, self.settings.eject_cooldown, self.name):
            for observer in self.observers:
                observer.ejected(self.name, replica.id)
            self._tell(HealthNews(replica.id, ejected_for=self.settings.eject_cooldown))

    def _tell(self, news: HealthNews) -> None:
        for listener in self.health_listeners:
            listener(news)

    def hear(self, news: HealthNews) -> None:
        """What another front of this gateway saw of one of these replicas (gateway/serving/front_feed.py)."""
        for replica in self.replicas:
            if replica.id == news.replica:
                replica.hear(news, self.name)

    # what each replica reports

    async def _scrape_loop(self) -> None:
        interval = self.settings.scrape_interval
        while not self._closed:
            await asyncio.gather(*(self._scraper.scrape(r) for r in list(self.replicas) if r.started))
            await asyncio.sleep(interval)

    # membership

    async def _resolve(self) -> list[str] | None:
        try:
            return await discover(getattr(self.settings, "base_url", ""), self.resolver)
        except Exception as exc:
            log.warning("backend %s: DNS lookup failed (%s); keeping %d replica(s)", self.name, describe(exc),
                        len(self.replicas))
            return None

    async def _dns_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.settings.dns_interval)
            ids = await self._resolve()
            if ids is not None:
                await self.set_replicas(ids)

    async def set_replicas(self, ids: Sequence[str]) -> None:
        """Membership changed: new replicas start (then take traffic), gone ones take no more and
        are closed once their requests have finished."""
        current = {r.id for r in self.replicas}
        added = [i for i in ids if i not in current]
        gone = [r for r in self.replicas if r.id not in set(ids)]
        for replica in gone:
            self.replicas.remove(replica)
            self.policy.forget(replica.id)
            self._tasks.append(asyncio.create_task(self._retire(replica)))
        if added or gone:
            log.info("backend %s: replicas %s joined, %s left", self.name, added, [r.id for r in gone])
        await asyncio.gather(*(self._add(i) for i in added))

    async def _retire(self, replica: Replica) -> None:
        while replica.in_flight > 0:
            await asyncio.sleep(0.1)
        await self._release(replica)

    def replica_states(self) -> list[Replica]:
        return list(self.replicas)

