"""Confidence bounds for the gates, valid however often a step is looked at.

Each look at a step spends part of its false-alarm budget: look n uses alpha_n = alpha * 6 / (pi^2 n^2),
and the alpha_n sum to alpha, so the chance that any look in a step wrongly fails (or wrongly passes) a
gate stays below alpha (a union bound over looks: simple, conservative, and needs no model of how the
figures drift, unlike a likelihood-ratio test). A step is looked at once its samples grew by half since
the last look (checked every `analysis_interval`), so n samples cost about log1.5(n) looks.
The bounds themselves are distribution-free: Wilson score intervals for rates, Newcombe's hybrid score
interval for a difference of rates, and order-statistic intervals for quantiles
(latencies are skewed and heavy-tailed, so nothing here assumes a normal latency)."""

from __future__ import annotations

import math
from statistics import NormalDist

Interval = tuple[float, float]


def spent_alpha(alpha: float, look: int) -> float:
    return alpha * 6 / (math.pi ** 2 * max(1, look) ** 2)


def z_for(alpha: float) -> float:
    """The two-sided normal quantile for 1 - alpha."""
    return NormalDist().inv_cdf(1 - alpha / 2)


def wilson(k: int, n: int, z: float) -> Interval:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def rate_difference(k1: int, n1: int, k2: int, n2: int, z: float) -> tuple[float, Interval]:
    """p1 - p2 and Newcombe's interval for it (method 10: from each rate's Wilson interval)."""
    p1, p2 = (k1 / n1 if n1 else 0.0), (k2 / n2 if n2 else 0.0)
    l1, u1 = wilson(k1, n1, z)
    l2, u2 = wilson(k2, n2, z)
    d = p1 - p2
    return d, (d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2))


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def quantile_bounds(values: list[float], q: float, z: float) -> Interval:
    """The q-quantile's interval from order statistics: the ranks a Binomial(n, q) count falls between;
    0 or infinity where there are too few samples to bound it on that side."""
    n = len(values)
    if n == 0:
        return 0.0, math.inf
    ordered = sorted(values)
    spread = z * math.sqrt(n * q * (1 - q))
    low_rank, high_rank = math.floor(n * q - spread), math.ceil(n * q + spread)
    low = ordered[low_rank - 1] if low_rank >= 1 else 0.0
    high = ordered[high_rank - 1] if high_rank <= n else math.inf
    return low, high


def ratio_bounds(candidate: list[float], baseline: list[float], q: float, z: float) -> tuple[float | None, Interval]:
    """candidate's q-quantile / baseline's, and bounds for it from each side's interval (each at z)."""
    c, b = quantile(candidate, q), quantile(baseline, q)
    value = c / b if c is not None and b else None
    cl, ch = quantile_bounds(candidate, q, z)
    bl, bh = quantile_bounds(baseline, q, z)
    low = cl / bh if bh not in (0.0, math.inf) else 0.0
    high = ch / bl if bl > 0 else math.inf
    return value, (low, high)
