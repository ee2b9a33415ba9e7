"""A config entry → its backend: one backend as before, or a pool when the entry names several
replicas (`endpoints`, `discovery = "dns"`, or `replicas > 1` on an engine)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from backends.base import Backend, describe
from backends.pool.disaggregated import DisaggregatedPool
from backends.pool.discovery import Resolver, discover
from backends.pool.pool import PoolBackend
from backends.pool.settings import BalancePolicy, PoolFields
from backends.registry import get_backend_class

log = logging.getLogger("llmgw")


def make_backend(name: str, type_name: str, settings: Any, resolver: Resolver | None = None) -> Backend:
    cls = get_backend_class(type_name)
    if isinstance(settings, PoolFields) and settings.disaggregated:
        return http_disaggregated(name, settings, cls, resolver)  # type: ignore[return-value]
    if isinstance(settings, PoolFields) and settings.is_pool:
        return PoolBackend.for_http(name, settings, cls, resolver)  # type: ignore[return-value]
    replicas = getattr(settings, "replicas", 1)
    if isinstance(replicas, int) and replicas > 1:
        if getattr(settings, "prefill_replicas", 0):
            return engine_disaggregated(name, settings)  # type: ignore[return-value]
        return engine_pool(name, settings, replicas)  # type: ignore[return-value]
    return cls(name, settings)  # type: ignore[call-arg]


def engine_pool(name: str, settings: Any, replicas: int, role: str = "worker", balance: str | None = None,
                pool_name: str | None = None) -> PoolBackend:
    """`replicas` engine worker processes behind one balancer. Each replica is one worker backend
    (backends/engine_worker: its own process, KV cache and threads), made by that package's
    `worker_replica(name, settings, index)`; ids are `{name}-{role}-{i}`."""
    from backends import engine_worker

    make = getattr(engine_worker, "worker_replica", None)
    if make is None:
        raise ValueError("engine `replicas` needs backends.engine_worker.worker_replica, which is not there yet")
    # the workers' figures are read from memory (no HTTP), so often; they come every 0.5 s at least
    pool_settings = PoolFields(balance=balance or getattr(settings, "balance", "prefix"), scrape_interval=0.05,
                               stale_after=2.0, prefix_block_tokens=getattr(settings, "block_size", 16))
    ids = [f"{name}-{role}-{i}" for i in range(replicas)]
    return PoolBackend(pool_name or name, pool_settings,
                       lambda replica_id: make(replica_id, settings, ids.index(replica_id)), "engine",
                       replica_ids=ids, replica_source=settings)


def engine_disaggregated(name: str, settings: Any) -> DisaggregatedPool:
    """`prefill_replicas` prefill workers (balanced by prefix) and the rest decode workers (by load)."""
    prefill = engine_pool(name, settings, settings.prefill_replicas, "prefill", "prefix", name)
    decode = engine_pool(name, settings, settings.replicas - settings.prefill_replicas, "decode", "least_load", name)
    return DisaggregatedPool(name, prefill, decode, settings.pd_threshold_tokens, settings.prefill_timeout,
                             decode_caches_prefixes=settings.enable_prefix_caching)


def http_disaggregated(name: str, settings: Any, cls: type[Backend], resolver: Resolver | None) -> DisaggregatedPool:
    """vLLM's prefill/decode over HTTP: a pool of `prefill_endpoints` (by prefix: a replica that prefilled a
    prefix has it cached) and one of `decode_endpoints` (by load). vLLM caches prefixes by default, so the
    decode replica's cache counts against the threshold."""
    prefill = _role_pool(name, settings, settings.prefill_endpoints, "prefix", cls, resolver)
    decode = _role_pool(name, settings, settings.decode_endpoints, "least_load", cls, resolver)
    return DisaggregatedPool(name, prefill, decode, settings.pd_threshold_tokens, settings.prefill_timeout,
                             decode_caches_prefixes=True)


def _role_pool(name: str, settings: Any, urls: list[str], balance: BalancePolicy, cls: type[Backend],
               resolver: Resolver | None) -> PoolBackend:
    """One role's pool: its URLs as `endpoints`, or with DNS every address of each URL's host."""
    dns = settings.discovery == "dns"
    role = msgspec.structs.replace(settings, prefill_endpoints=[], decode_endpoints=[], balance=balance,
                                   base_url=urls[0] if dns else "", endpoints=[] if dns else list(urls))
    if not dns:
        return PoolBackend.for_http(name, role, cls, resolver)
    pool = _NamesPool.for_http(name, role, cls, resolver)
    pool.dns_urls = list(urls)  # type: ignore[attr-defined]
    return pool


class _NamesPool(PoolBackend):
    """DNS discovery over several URLs (a role may list one headless Service per zone): the replicas are
    every address of each URL's host, at that URL's scheme, port and path."""

    dns_urls: list[str] = []

    async def _resolve(self) -> list[str] | None:
        try:
            found = await asyncio.gather(*(discover(url, self.resolver) for url in self.dns_urls))
        except Exception as exc:  # as the pool's own lookup: keep the replicas it has
            log.warning("backend %s: DNS lookup failed (%s); keeping %d replica(s)", self.name, describe(exc),
                        len(self.replicas))
            return None
        return list(dict.fromkeys(url for urls in found for url in urls))


def engine_workers_of(backend: Backend) -> list[Backend]:
    """The engine worker backends `backend` runs: itself, or an engine pool's replicas (made here, unstarted:
    a pool makes its own only when it starts). A multi-process gateway's supervisor starts these."""
    from backends.engine_worker import EngineWorkerBackend

    if isinstance(backend, DisaggregatedPool):
        return engine_workers_of(backend.prefill) + engine_workers_of(backend.decode)
    if isinstance(backend, PoolBackend):
        return [backend.factory(rid) for rid in backend.fixed_ids] if backend.type_name == "engine" else []
    return [backend] if isinstance(backend, EngineWorkerBackend) else []
