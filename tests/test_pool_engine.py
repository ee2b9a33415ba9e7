"""A pool of two engine worker processes (backends/engine_worker) of the embedded model behind the
balancer: both serve, each shared prefix stays on one worker (whose prefix cache then hits), a killed
worker's stream fails cleanly and the worker comes back, and every block is free at the end; through a real
gateway, the metrics and /admin/backends show each worker."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.base import BackendError, GenerationRequest
from backends.engine import EngineSettings
from backends.pool.build import engine_pool
from tests.server import CLIENT_TIMEOUT, ENGINE_CONFIG, running_gateway, wait_until


class ChoiceLog:
    """A PoolObserver that remembers where each request went."""

    def __init__(self) -> None:
        self.picks: list[tuple[str, str]] = []

    def chosen(self, pool: str, replica: str, reason: str) -> None:
        self.picks.append((replica, reason))

    def first_token(self, pool: str, replica: str, seconds: float) -> None:
        return None

    def failed(self, pool: str, replica: str, kind: str) -> None:
        raise AssertionError(f"{replica} failed: {kind}")

    def ejected(self, pool: str, replica: str) -> None:
        raise AssertionError(f"{replica} ejected")


async def test_two_engine_workers_keep_each_shared_prefix_on_one_worker(smollm_dir: Path) -> None:
    settings = EngineSettings(model=str(smollm_dir), dtype="float32", kv_cache_mb=32, enable_prefix_caching=True,
                              workers="process")
    pool = engine_pool("local", settings, 2)
    log = ChoiceLog()
    pool.observers.append(log)
    await pool.start()
    try:
        assert await pool.health() and len({r.backend.pid for r in pool.replicas}) == 2  # type: ignore[attr-defined]
        homes: dict[int, set[str]] = defaultdict(set)
        for question in range(3):
            for group in range(4):
                prompt = f"You are the assistant of team {group}; answer briefly and politely. " * 8 + \
                    f"Question {question}: what is {question} plus {group}?"
                request = GenerationRequest(request_id=f"{group}-{question}", model="m", prompt=prompt,
                                            max_new_tokens=4)
                async with asyncio.timeout(CLIENT_TIMEOUT):
                    events = [e async for e in pool.generate(request)]
                assert events[-1].finished and events[-1].usage is not None
                homes[group].add(log.picks[-1][0])
        assert all(len(h) == 1 for h in homes.values())  # a group's prompts all went to one worker
        assert {next(iter(h)) for h in homes.values()} == {r.id for r in pool.replicas}  # both served
        assert [reason for _, reason in log.picks].count("prefix_hit") == 8  # all but each group's first
        loads = [r.backend.load() for r in pool.replicas]  # type: ignore[attr-defined]
        assert all(load is not None and load.prefix_cache_hits > 0 for load in loads)

        async def all_free() -> None:
            while not all((lo := r.backend.load()) is not None and lo.all_blocks_free and lo.running == 0  # type: ignore[attr-defined]
                          for r in pool.replicas):
                await asyncio.sleep(0.05)

        async with asyncio.timeout(CLIENT_TIMEOUT):
            await all_free()
        assert all(r.in_flight == 0 and r.outstanding_tokens == 0 for r in pool.replicas)
    finally:
        await pool.aclose()


class FailureLog(ChoiceLog):
    def __init__(self) -> None:
        super().__init__()
        self.failures: list[tuple[str, str]] = []

    def failed(self, pool: str, replica: str, kind: str) -> None:
        self.failures.append((replica, kind))

    def ejected(self, pool: str, replica: str) -> None:
        return None


async def test_a_killed_worker_fails_its_streams_cleanly_comes_back_and_serves_again(smollm_dir: Path) -> None:
    """SIGKILL one worker of two while it streams: that stream ends with a typed backend error (no hang),
    the pool goes on serving from the other, the killed worker is restarted and takes requests again,
    and every block of both is free at the end."""
    settings = EngineSettings(model=str(smollm_dir), dtype="float32", kv_cache_mb=32, workers="process",
                              balance="round_robin")
    pool = engine_pool("local", settings, 2)
    log = FailureLog()
    pool.observers.append(log)
    await pool.start()
    try:
        long = GenerationRequest(request_id="long", model="m", prompt="Count slowly:", max_new_tokens=400,
                                 ignore_eos=True)
        stream = pool.generate(long)
        async with asyncio.timeout(CLIENT_TIMEOUT):
            first = await anext(stream)
        assert not first.finished
        victim = next(r for r in pool.replicas if r.id == log.picks[-1][0])
        old_pid = victim.backend.pid  # type: ignore[attr-defined]
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(BackendError):
            async with asyncio.timeout(CLIENT_TIMEOUT):
                async for event in stream:
                    assert not event.finished  # 400 tokens cannot all have come before the kill
        assert any(replica == victim.id for replica, _ in log.failures)

        def back() -> bool:
            b = victim.backend
            return b.restarts == 1 and b.pid not in (None, old_pid) and b.state == "ready"  # type: ignore[attr-defined]

        await asyncio.to_thread(wait_until, back, "the killed worker to be restarted")
        served: set[str] = set()
        for i in range(6):  # round robin: both replicas, the restarted one included, answer
            request = GenerationRequest(request_id=f"after-{i}", model="m", prompt=f"Say {i}.", max_new_tokens=3)
            async with asyncio.timeout(CLIENT_TIMEOUT):
                events = [e async for e in pool.generate(request)]
            assert events[-1].finished
            served.add(log.picks[-1][0])
        assert served == {r.id for r in pool.replicas}

        def all_free() -> bool:
            return all((lo := r.backend.load()) is not None and lo.all_blocks_free and lo.running == 0  # type: ignore[attr-defined]
                       for r in pool.replicas)

        await asyncio.to_thread(wait_until, all_free, "both workers to hold no blocks")
    finally:
        await pool.aclose()


POOL_GATEWAY_CONFIG = ENGINE_CONFIG.replace(
    'type = "engine"\n', 'type = "engine"\nworkers = "process"\nreplicas = 2\nbalance = "round_robin"\n') + """
[server]
admin_key = "pool-admin"
health_check_interval = 0.2
eject_cooldown = 1.0
"""
WORKERS = ("local-worker-0", "local-worker-1")


def _by_worker(url: str, name: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text
    return {s.labels["backend"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and s.labels.get("backend") in WORKERS}


def test_a_pool_of_workers_shows_each_one_in_the_metrics_and_admin_backends(tmp_path: Path) -> None:
    """Through a real gateway with `replicas = 2`: the engine's step and KV figures and the worker gauges
    are labelled per worker, and while a killed worker restarts, /health stays 200 (the other serves) and
    /admin/backends names it."""
    with running_gateway(POOL_GATEWAY_CONFIG, tmp_path) as url:
        for i in range(2):  # round robin: one each
            done = httpx.post(f"{url}/generate", json={"inputs": f"Say {i}.", "parameters": {"max_new_tokens": 3}},
                              timeout=CLIENT_TIMEOUT)
            assert done.status_code == 200
        steps = wait_until(lambda: (s := _by_worker(url, "llmgw_engine_batch_size_count")) and len(s) == 2 and s,
                           "both workers' step figures")
        assert all(v >= 1 for v in steps.values())
        assert all(v > 0 for v in _by_worker(url, "llmgw_engine_kv_blocks_total").values())
        assert _by_worker(url, "llmgw_engine_worker_up") == dict.fromkeys(WORKERS, 1.0)
        pid = int(_by_worker(url, "llmgw_engine_worker_pid")["local-worker-1"])
        os.kill(pid, signal.SIGKILL)
        admin = {"authorization": "Bearer pool-admin"}

        def restarting() -> str | None:
            state = httpx.get(f"{url}/admin/backends", headers=admin, timeout=CLIENT_TIMEOUT).json()["backends"]
            return state["local"] if "local-worker-1" in state["local"] and "restart 1" in state["local"] else None

        said = wait_until(restarting, "/admin/backends naming the restarting worker")
        assert "1/2 replicas healthy" in said and "SIGKILL" in said, said
        assert httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT).status_code == 200  # the other one serves
        wait_until(lambda: _by_worker(url, "llmgw_engine_worker_restarts_total") ==
                   {"local-worker-0": 0.0, "local-worker-1": 1.0} and
                   _by_worker(url, "llmgw_engine_worker_up") == dict.fromkeys(WORKERS, 1.0), "the worker back")
        assert int(_by_worker(url, "llmgw_engine_worker_pid")["local-worker-1"]) != pid
