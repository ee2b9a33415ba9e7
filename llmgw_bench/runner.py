"""Load shapes: a closed loop at fixed concurrency, or open-loop arrivals at a request rate.

Both start with a warm-up at the same load, excluded from the figures, and stop issuing requests at a
request count or a duration; requests already sent are always waited for and counted.
Arrivals follow `vllm bench serve`: Gamma(shape=burstiness, scale=1/(rate·burstiness)) gaps (Poisson at
burstiness 1), rescaled so the last of N requests arrives at exactly N/rate.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from llmgw_bench.api import RequestResult, request_body, send
from llmgw_bench.workload import Sample


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int | None = None  # closed loop
    request_rate: float | None = None  # open loop, requests/s
    burstiness: float = 1.0
    max_concurrency: int | None = None  # cap for the open loop
    num_requests: int | None = None
    duration: float | None = None  # seconds of issuing requests
    warmup: int = 0

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency else f"rate={self.request_rate:g}"


@dataclass(frozen=True)
class Target:
    url: str
    api: str
    model: str | None
    headers: dict[str, str]
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None
    timeout: float = 600.0


def arrival_times(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent."""
    rng = random.Random(seed)
    gaps = [rng.gammavariate(burstiness, 1 / (rate * burstiness)) for _ in range(count)]
    times = list(itertools.accumulate(gaps))
    scale = (count / rate) / times[-1] if times and times[-1] > 0 else 1.0
    return [t * scale for t in times]


async def run_load(target: Target, samples: list[Sample], load: LoadSpec, *, seed: int = 0,
                   on_done: Callable[[RequestResult], None] | None = None,
                   on_start: Callable[[], None] | None = None) -> tuple[list[RequestResult], float]:
    """The measured requests and the run's duration (first send to last answer); `on_start` is called after
    the warm-up, before the first measured request."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=target.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=target.headers) as session:
        cycle = itertools.cycle(samples)

        def one(sample: Sample, zero: float) -> Any:
            body = request_body(target.api, sample, model=target.model, temperature=target.temperature,
                                ignore_eos=target.ignore_eos, seed=target.seed)
            return send(session, target.url, target.api, body, RequestResult(0.0, sample.input_len), zero)

        if load.warmup:
            width = load.concurrency or load.max_concurrency or load.warmup
            await _closed_loop(one, cycle, width, load.warmup, None)
        if on_start is not None:
            on_start()
        zero = time.perf_counter()
        if load.concurrency:
            results = await _closed_loop(one, cycle, load.concurrency, load.num_requests, load.duration, zero, on_done)
        else:
            results = await _open_loop(one, cycle, load, seed, zero, on_done)
    ends = [r.start + (r.latency or 0.0) for r in results]
    duration = max(ends, default=0.0) or (time.perf_counter() - zero)
    return results, duration


async def _closed_loop(one: Callable[..., Any], samples: Iterator[Sample], width: int, count: int | None,
                       duration: float | None, zero: float | None = None,
                       on_done: Callable[[RequestResult], None] | None = None) -> list[RequestResult]:
    zero = time.perf_counter() if zero is None else zero
    deadline = zero + duration if duration else None
    remaining = [count if count is not None else 1 << 62]
    results: list[RequestResult] = []

    async def worker() -> None:
        while remaining[0] > 0 and (deadline is None or time.perf_counter() < deadline):
            remaining[0] -= 1
            result = await one(next(samples), zero)
            results.append(result)
            if on_done:
                on_done(result)

    await asyncio.gather(*(worker() for _ in range(width)))
    return results


async def _open_loop(one: Callable[..., Any], samples: Iterator[Sample], load: LoadSpec, seed: int, zero: float,
                     on_done: Callable[[RequestResult], None] | None) -> list[RequestResult]:
    assert load.request_rate
    count = load.num_requests or int(load.request_rate * (load.duration or 60)) or 1
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    results: list[RequestResult] = []

    async def fire(sample: Sample) -> None:
        if limit is not None:
            async with limit:
                result = await one(sample, zero)
        else:
            result = await one(sample, zero)
        results.append(result)
        if on_done:
            on_done(result)

    tasks = []
    for at in arrival_times(count, load.request_rate, load.burstiness, seed):
        if load.duration and at > load.duration:
            break
        delay = zero + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(fire(next(samples))))
    await asyncio.gather(*tasks)
    return results
