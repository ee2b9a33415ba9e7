"""Shadow traffic: mirror a sample of requests to a candidate backend and compare the answers.

The candidate runs in the background: it never delays or changes the primary response, at most
`max_concurrency` mirrored requests run at once per model (more are dropped and counted), and
each finished pair records both sides' TTFT, latency, token count and error, whether the outputs
match exactly, and how long their common prefix is. The last few diverging answers of each pair are kept
(in memory only, never logged) so the admin console can show what differs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from backends.base import Backend, GenerationRequest, TokenEvent, describe
from gateway.closing import close_detached

KEPT_DIVERGENCES = 20  # diverging answers kept per (model, primary, candidate)
KEPT_TEXT_CHARS = 4000  # of each answer: enough to see the difference, bounded memory


@dataclass
class Side:
    ttft: float | None = None
    latency: float = 0.0
    text: str = ""
    tokens: int = 0
    error: str | None = None
    prompt_tokens: int | None = None  # from the final usage, where the backend reports one
    tokens_text: list[str] = field(default_factory=list)  # each event's token text: where answers diverge
    top_texts: list[set[str]] = field(default_factory=list)  # each event's top-k tokens, where sent

    def add(self, event: TokenEvent) -> None:
        self.text += event.text
        self.tokens += 1
        self.tokens_text.append(event.token_text)
        self.top_texts.append({t.text for t in event.top_logprobs})
        if event.finished and event.usage is not None:
            self.prompt_tokens = event.usage.prompt_tokens


@dataclass
class PairStats:
    compared: int = 0
    exact: int = 0
    prefix_ratios: list[float] = field(default_factory=list)
    primary: list[Side] = field(default_factory=list)
    candidate: list[Side] = field(default_factory=list)
    dropped: int = 0


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _side_summary(sides: list[Side]) -> dict[str, Any]:
    ok = [s for s in sides if s.error is None]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    latencies = [s.latency for s in ok]
    return {"requests": len(sides), "error_rate": (len(sides) - len(ok)) / len(sides) if sides else 0.0,
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p95_s": percentile(ttfts, 0.95),
            "latency_p50_s": percentile(latencies, 0.5), "latency_p95_s": percentile(latencies, 0.95),
            "mean_tokens": sum(s.tokens for s in ok) / len(ok) if ok else None}


class ShadowPair:
    def __init__(self, recorder: ShadowRecorder, key: tuple[str, str, str], greedy: bool = False) -> None:
        self.recorder = recorder
        self.key = key
        self.greedy = greedy  # both answers are then the same unless the backends differ
        self.primary: Side | None = None
        self.candidate: Side | None = None
        self.discarded = False

    def done(self, primary: Side | None = None, candidate: Side | None = None) -> None:
        self.primary = primary or self.primary
        self.candidate = candidate or self.candidate
        if self.primary is not None and self.candidate is not None and not self.discarded:
            self.recorder.record(self)


class ShadowRecorder:
    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics
        self.stats: dict[tuple[str, str, str], PairStats] = {}
        self.running: dict[tuple[str, str], int] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.pair_observers: list[Callable[[str, str, str, ShadowPair], None]] = []  # each finished pair
        self.divergences: dict[tuple[str, str, str], deque[dict[str, Any]]] = {}

    def mirror(self, model: str, primary: str, candidate: tuple[str, Backend], max_concurrency: int,
               request: GenerationRequest, topk: int = 0) -> ShadowPair | None:
        """Mirror `request` to the candidate (asking it for `topk` top logprobs per token, if more than the
        client asked for); the pair to hand the primary's events to (tap), or None when dropped."""
        name, backend = candidate
        key = (model, primary, name)
        stats = self.stats.setdefault(key, PairStats())
        if self.running.get((model, name), 0) >= max_concurrency:
            stats.dropped += 1  # the candidate is saturated: never queue behind it
            self._count(key, "dropped")
            return None
        pair = ShadowPair(self, key, greedy=request.greedy)
        copy = msgspec.structs.replace(request, request_id=f"shadow-{uuid.uuid4().hex}", stream=True)
        if topk > copy.top_logprobs:
            copy = msgspec.structs.replace(copy, logprobs=True, top_logprobs=topk)
        self.running[(model, name)] = self.running.get((model, name), 0) + 1
        task = asyncio.create_task(self._run_candidate(pair, backend, copy, (model, name)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return pair

    async def _run_candidate(self, pair: ShadowPair, backend: Backend, request: GenerationRequest,
                             slot: tuple[str, str]) -> None:
        side = Side()
        started = time.perf_counter()
        try:
            async for event in backend.generate(request):
                if side.ttft is None:
                    side.ttft = time.perf_counter() - started
                side.add(event)
                if event.finished:
                    break
        except Exception as exc:
            side.error = describe(exc)
        finally:
            side.latency = time.perf_counter() - started
            self.running[slot] -= 1
        pair.done(candidate=side)

    def record(self, pair: ShadowPair) -> None:
        assert pair.primary is not None and pair.candidate is not None
        stats = self.stats.setdefault(pair.key, PairStats())
        stats.primary.append(pair.primary)
        stats.candidate.append(pair.candidate)
        if pair.primary.error is None and pair.candidate.error is None:
            stats.compared += 1
            a, b = pair.primary.text, pair.candidate.text
            stats.exact += a == b
            stats.prefix_ratios.append(common_prefix(a, b) / max(len(a), len(b)) if (a or b) else 1.0)
            self._count(pair.key, "exact" if a == b else "differ")
            if a != b:
                model, primary, candidate = pair.key
                kept = self.divergences.setdefault(pair.key, deque(maxlen=KEPT_DIVERGENCES))
                kept.append({"model": model, "primary": primary, "candidate": candidate, "at": time.time(),
                             "primary_text": a[:KEPT_TEXT_CHARS], "candidate_text": b[:KEPT_TEXT_CHARS],
                             "truncated": max(len(a), len(b)) > KEPT_TEXT_CHARS})
        else:
            self._count(pair.key, "error")
        for observe in self.pair_observers:
            observe(*pair.key, pair)

    def _count(self, key: tuple[str, str, str], outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.shadow.labels(*key, outcome).inc()

    def report(self) -> list[dict[str, Any]]:
        rows = []
        for (model, primary, candidate), stats in sorted(self.stats.items()):
            rows.append({
                "model": model, "primary": primary, "candidate": candidate, "compared": stats.compared,
                "exact_match_rate": stats.exact / stats.compared if stats.compared else None,
                "mean_common_prefix_ratio": (sum(stats.prefix_ratios) / len(stats.prefix_ratios)
                                             if stats.prefix_ratios else None),
                "dropped": stats.dropped, "primary_stats": _side_summary(stats.primary),
                "candidate_stats": _side_summary(stats.candidate)})
        return rows

    def recent_divergences(self) -> list[dict[str, Any]]:
        """The kept diverging answers of every pair, newest first."""
        return sorted((d for kept in self.divergences.values() for d in kept), key=lambda d: -d["at"])


async def tap(events: AsyncIterator[TokenEvent], pair: ShadowPair, started: float) -> AsyncIterator[TokenEvent]:
    """Pass the primary's events through unchanged, noting what the comparison needs
    (`started`: the perf_counter() when the primary request was sent)."""
    side = Side()
    finished = False
    try:
        async for event in events:
            if side.ttft is None:
                side.ttft = time.perf_counter() - started
            side.add(event)
            finished = finished or event.finished
            yield event
    except Exception as exc:
        side.error = describe(exc)
        raise
    finally:
        await close_detached(events)
        side.latency = time.perf_counter() - started
        if finished or side.error is not None:
            pair.done(primary=side)
        else:
            pair.discarded = True  # the client left: nothing to compare
