"""Prefill/decode disaggregation: one backend over a prefill pool and a decode pool (replica-routing.md §6).

A long prompt stalls every stream decoding on its replica while it is prefilled. Here a request whose
uncached prompt is long enough goes in two legs: a prefill replica computes the prompt's KV (and, for our
engine, the first token, which the client gets at once), hands the KV over, and the decode replica the load
balancer chose streams the rest. The rule is llm-d's `prefix-based-pd-decider`: the decode replica is chosen
first, and the prefill goes remote only when `prompt tokens - tokens that replica has cached >= threshold`
(the cached part estimated from the prompts this gateway sent there). Short or mostly cached prompts are served
by the decode replica alone.

Failures: a prefill leg that fails or times out is dropped (its replica told to free what it holds) and the
decode replica serves the whole request; the client sees nothing of it. A decode leg that fails ends the
request with the error, as any backend. Whatever ends the request, the prefill replica is told to free the
handed-over KV. The prefill pool balances by prefix (a replica that has prefilled a prefix has it cached),
the decode pool by load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec

from backends.base import (
    BackendError,
    BackendInfo,
    GenerationRequest,
    KvHandoff,
    KvTransfer,
    TokenEvent,
    TokenSpan,
    UpstreamError,
    describe,
)
from backends.pool.pool import PoolBackend
from backends.pool.prefix_index import PrefixIndex, prompt_tokens, request_block_hashes
from backends.pool.replica import Replica

log = logging.getLogger("llmgw")
Path = Literal["local", "remote", "fallback"]  # decode alone; two legs; two legs tried, decode alone after all


@dataclass
class Handover:
    """How one request was served, for the metrics and the access log."""

    path: Path
    decode_replica: str
    prefill_replica: str | None = None
    num_bytes: int = 0  # KV handed over
    seconds: float = 0.0  # written (prefill leg) + read in (decode leg)
    fallback: str | None = None  # why the two legs did not happen as planned


class DisaggregationObserver(Protocol):
    def handed_over(self, pool: str, handover: Handover) -> None: ...


class DisaggregatedPool:
    """A Backend over `prefill` and `decode` pools of one model; the gateway sees one backend."""

    def __init__(self, name: str, prefill: PoolBackend, decode: PoolBackend, threshold_tokens: int,
                 prefill_timeout: float, decode_caches_prefixes: bool = True) -> None:
        self.name = name
        self.type_name = decode.type_name
        self.prefill = prefill
        self.decode = decode
        self.settings = decode.settings  # the pool fields the gateway reads (stale_seconds)
        self.threshold_tokens = threshold_tokens
        self.prefill_timeout = prefill_timeout
        # prompts sent to each decode replica: what its prefix cache holds, if it keeps one
        self.cached = PrefixIndex(decode.settings.prefix_capacity) if decode_caches_prefixes else None
        self.observers: list[Any] = []  # the gateway's PoolObserver; both pools report to it too
        prefill.observers = decode.observers = self.observers
        self._releases: set[asyncio.Task[None]] = set()

    # lifecycle and the Backend protocol, mostly the decode pool's

    async def start(self) -> None:
        await asyncio.gather(self.prefill.start(), self.decode.start())

    async def aclose(self) -> None:
        for task in list(self._releases):
            with contextlib.suppress(Exception):
                await task
        await asyncio.gather(self.prefill.aclose(), self.decode.aclose())

    def carry_over(self, old: Any) -> None:
        if isinstance(old, DisaggregatedPool):
            self.prefill.carry_over(old.prefill)
            self.decode.carry_over(old.decode)

    async def health(self) -> bool:
        """Healthy while a decode replica serves: without prefill replicas, decode serves every request whole."""
        _, decode = await asyncio.gather(self.prefill.health(), self.decode.health())
        return decode

    def info(self) -> BackendInfo:
        return self.decode.info()

    def startup_step(self) -> str | None:
        return self.decode.startup_step() or self.prefill.startup_step()

    def adapters(self) -> dict[str, Any]:
        return self.decode.adapters()

    async def load_adapter(self, name: str, path: str) -> None:
        await self.decode.load_adapter(name, path)
        try:
            await self.prefill.load_adapter(name, path)
        except BackendError:
            with contextlib.suppress(BackendError):
                await self.decode.unload_adapter(name)
            raise

    async def unload_adapter(self, name: str) -> None:
        await self.decode.unload_adapter(name)
        await self.prefill.unload_adapter(name)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[TokenSpan]:
        return await self.decode.tokenize(text, add_special_tokens)

    def replica_states(self) -> list[Replica]:
        return [*self.prefill.replica_states(), *self.decode.replica_states()]

    def role_of(self, replica_id: str) -> str:
        return "prefill" if any(r.id == replica_id for r in self.prefill.replicas) else "decode"

    def describe(self) -> str:
        return (f"prefill/decode: prefill replicas {', '.join(r.id for r in self.prefill.replicas)} (prefix "
                f"balance), decode replicas {', '.join(r.id for r in self.decode.replicas)} (least load); "
                f"prefill goes remote from {self.threshold_tokens} uncached prompt tokens")

    # requests

    def _uncached_tokens(self, request: GenerationRequest, decode_replica: str) -> int:
        """The prompt's tokens the decode replica has no KV for, estimated from what was sent there."""
        if self.cached is None:
            return prompt_tokens(request)
        s = self.decode.settings
        hashes = request_block_hashes(request, s.prefix_block_tokens, s.prefix_block_chars, s.prefix_max_blocks)
        matched = self.cached.match(hashes).get(decode_replica, 0)
        self.cached.insert(decode_replica, hashes)
        per_block = s.prefix_block_tokens if request.prompt_token_ids else s.prefix_block_chars / 4
        return max(0, prompt_tokens(request) - int(matched * per_block))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        choice = self.decode.choose(request)
        handover = Handover("local", choice.replica.id)
        uncached = self._uncached_tokens(request, choice.replica.id)
        if uncached < self.threshold_tokens or not self.prefill._candidates(set()):
            try:
                async for event in self.decode.generate(request, choice):
                    yield event
            finally:
                self._report(handover)
            return
        transfer_id = uuid.uuid4().hex
        prefill_served: list[Replica] = []
        first: list[TokenEvent] = []
        try:
            try:
                first = await self._prefill_leg(request, transfer_id, prefill_served)
            except (BackendError, TimeoutError) as exc:
                if isinstance(exc, BackendError) and not exc.retriable:  # the request's own fault: same on decode
                    raise
                handover.path, handover.fallback = "fallback", _why(exc, self.prefill_timeout)
                log.warning("backend %s: prefill of request %s failed (%s); the decode replica prefills it",
                            self.name, request.request_id, handover.fallback)
            if prefill_served:
                handover.prefill_replica = prefill_served[-1].id
            if handover.path == "fallback":
                self._release(prefill_served, transfer_id)
                async for event in self.decode.generate(request, choice):
                    yield event
                return
            handover.path = "remote"
            last = first[-1]
            if not last.handed_over:  # it finished at its first token: nothing to hand over
                for event in first:
                    yield event
                return
            handoff = last.kv_handoff
            assert handoff is not None
            handover.num_bytes, handover.seconds = handoff.num_bytes, handoff.seconds
            if handoff.token_is_output:
                yield msgspec.structs.replace(last, kv_handoff=None)
            leg = msgspec.structs.replace(request, kv_transfer=KvTransfer(role="decode", transfer_id=transfer_id,
                                                                          params=handoff.params))
            async for event in self.decode.generate(leg, choice):
                if event.kv_handoff is not None:  # the decode leg's first event: it has the KV (or prefilled)
                    self._took(handover, event.kv_handoff)
                    self._release(prefill_served, transfer_id)
                    event = msgspec.structs.replace(event, kv_handoff=None)
                yield event
        finally:
            self._release(prefill_served, transfer_id)
            self._report(handover)

    async def _prefill_leg(self, request: GenerationRequest, transfer_id: str,
                           served: list[Replica]) -> list[TokenEvent]:
        """The prefill leg's events up to its handover (or its finish, when the first token ended it)."""
        leg = msgspec.structs.replace(request, kv_transfer=KvTransfer(role="prefill", transfer_id=transfer_id))
        events: list[TokenEvent] = []
        async with asyncio.timeout(self.prefill_timeout):
            stream = self.prefill.generate(leg, served=served)
            try:
                async for event in stream:
                    events.append(event)
                    if event.finished:
                        return events
            finally:
                await stream.aclose()
        raise UpstreamError(f"{self.name}: the prefill leg ended without handing over")

    def _took(self, handover: Handover, handoff: KvHandoff) -> None:
        handover.seconds += handoff.seconds
        if handoff.imported is False:
            handover.path, handover.fallback = "fallback", f"the decode replica prefilled: {handoff.reason}"

    def _release(self, served: list[Replica], transfer_id: str) -> None:
        """Tell the prefill replica (once) to free what it holds for this transfer, off the request's path."""
        replicas = list(served)
        served.clear()
        for replica in replicas:  # the one that served, and any that failed before it (one may have died mid-write)
            release = getattr(replica.backend, "release_kv", None)
            if release is None:  # vLLM frees by itself once the decode side has pulled (delayed free)
                continue
            task = asyncio.create_task(_quietly(release(transfer_id)))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    def _report(self, handover: Handover) -> None:
        for observer in self.observers:
            report = getattr(observer, "handed_over", None)
            if report is not None:
                report(self.name, handover)


def _why(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no handover within {timeout:g} s"
    return describe(exc)


async def _quietly(release: Any) -> None:
    started = time.perf_counter()
    try:
        await release
    except Exception as exc:  # the replica is gone: its restart frees everything anyway
        log.debug("releasing a KV handover failed after %.3f s: %s", time.perf_counter() - started, describe(exc))
