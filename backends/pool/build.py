"""A config entry → its backend: one backend as before, or a pool when the entry names several
replicas (`endpoints`, `discovery = "dns"`, or `replicas > 1` on an engine)."""

from __future__ import annotations

from typing import Any

from backends.base import Backend
from backends.pool.disaggregated import DisaggregatedPool
from backends.pool.discovery import Resolver
from backends.pool.pool import PoolBackend
from backends.pool.settings import PoolFields
from backends.registry import get_backend_class


def make_backend(name: str, type_name: str, settings: Any, resolver: Resolver | None = None) -> Backend:
    cls = get_backend_class(type_name)
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
