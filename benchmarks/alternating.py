"""Alternating windows for benchmarks/gateway_overhead.py: several gateways up at once, loaded in turn.

On a shared 2-core VM a 10-second run's rate moved by 10-30% with the machine's load from minute to minute.
Windows a few seconds apart share that load, so the ratio of two gateways' rates window by window is the steadier
comparison: `run` warms each gateway up, then takes them in turn for `windows` rounds of `seconds` at c=16 (the
order rotating each round); `report` prints each variant's per-window ratio to the baseline (the first name).
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Callable
from typing import Any

import loadgen
import overhead_services as services

CONCURRENCY = 16


def own_key(key_body: dict | None, name: str) -> dict | None:
    """The variant's key body with a name of its own (a key name is unique in a state database)."""
    return dict(key_body, name=f"ab-{name}") if key_body else None


def run(starters: dict[str, Callable[[], tuple[Any, int, str]]], body: dict, windows: int,
        seconds: float) -> dict[str, list[float]]:
    """c=16 req/s of each gateway, window by window. `starters` start each (-> process, port, token); the first
    is the baseline."""
    started = {}
    try:
        for name, start in starters.items():
            started[name] = start()
        requests = {name: loadgen.build_request("127.0.0.1", port, "/v1/chat/completions", json.dumps(body).encode(),
                                                {"authorization": f"Bearer {token}"})
                    for name, (_, port, token) in started.items()}
        names = list(started)
        for name in names:  # warm-up, as gateway_overhead.measure() does
            asyncio.run(loadgen.run("127.0.0.1", started[name][1], requests[name], CONCURRENCY, count=2000))
        rates: dict[str, list[float]] = {name: [] for name in names}
        for index in range(windows):
            for name in names[index % len(names):] + names[:index % len(names)]:
                result = asyncio.run(loadgen.run("127.0.0.1", started[name][1], requests[name], CONCURRENCY,
                                                 duration=seconds))
                rates[name].append(result.rate)
        return rates
    finally:
        for proc, _, _ in started.values():
            services.stop(proc)


def report(rates: dict[str, list[float]], floor: float) -> None:
    if len(rates) < 2:
        return
    base_name, *others = rates
    base = rates[base_name]
    for name in others:
        ratios = sorted(a / b for a, b in zip(rates[name], base))
        q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(f"{name} vs {base_name}, alternating windows: c16 req/s {statistics.median(rates[name]):.1f} "
              f"against {statistics.median(base):.1f}; ratio per window median {median:.3f}x "
              f"(quartiles {q1:.3f}-{q3:.3f}, {len(ratios)} windows; target >= {floor}x: "
              f"{'ok' if median >= floor else 'MISSED'})")
