"""Balancing policies: which replica gets a request, and why. A policy is a small object over the
replicas' signals, so a new one is a new class (as SGLang's router and llm-d's scorers are).

The signals: `Replica.load()` (requests on it: its own fresh /metrics report of waiting + running,
never less than this gateway's in-flight count there), outstanding tokens (this gateway's estimate),
KV usage (reported, fresh only), and the prefix index.

`prefix` (the default) is SGLang router's `cache_aware` gate, over our block-hash index:

1. Imbalanced load ignores affinity: when `max_load - min_load > balance_abs_threshold` (8) and
   `max_load > balance_rel_threshold * min_load` (1.5), the least-loaded replica gets the request
   (reason `imbalanced`). SGLang's defaults are 64 and 1.5; 64 requests of difference never
   happens on a pool of a few replicas (the reference note's pitfall), so the absolute gate here is
   8, what a third-party tuning of SGLang's router uses for pools under 8 replicas. Both
   conditions, so a pool at 1 vs 3 requests is not "imbalanced", nor 100 vs 120. And only while
   the busiest replica is queueing: a fresh report of no waiting requests keeps affinity, whatever
   the difference. Requests running on a replica share its batch steps at little cost (a decode step
   reads the weights once for the whole batch), while a moved request pays a cold prefill and its
   prefix evicts another group's on the other replica. In the routing benchmark at 16 in flight
   (8 groups on 2 one-thread replicas) the gate without this condition fired on 21 of 64 requests,
   cut the hit rate from 77% to 65% and put `prefix` below round robin (120 against 132 tok/s).
   Without a fresh report the gateway cannot tell waiting from running, and the counts decide.
2. Otherwise the replica holding the longest run of the prompt's leading blocks gets it (reason
   `prefix_hit`), if that run is at least `cache_threshold` (0.3, SGLang's default) of the prompt's
   blocks; ties go to the lower load. Reusing a cached prefix saves its whole prefill, which is
   worth more than a small load difference: llm-d weighs prefix 3 against queue 2 and KV 2.
3. A cold prompt (no such match, or too short for one block) goes to the replica holding the
   fewest blocks in the index (Ray's "smallest tree", the rule of SGLang's cache_aware header),
   ties to the least-loaded and then in turn (reason `cold`). A cold prompt usually starts a
   prefix whose later prompts will follow it, so its choice lasts: the blocks routed to a replica
   measure the demand it already carries, while its load at this instant (one request more or
   less, at a few in flight) is noise on that scale. Load still rules past the gate of step 1.
   Ordering by load first split 8 equal prefix groups 5:3 between two replicas in the routing
   benchmark, with one replica idle a third of the run; by blocks it splits them 4:4. Replicas
   within half the prompt's blocks of the fewest count as level, so that load and then turn decide
   among them: unrelated prompts a block apart in length otherwise went two in a row to one replica
   (in the zero-reuse control with ~2,000-token prompts, 0.95x round robin's throughput and twice
   its TTFT p90).

Whichever replica is chosen, the prompt's blocks are recorded for it. `least_load` always takes
the least-loaded replica (reason `least_load`); `round_robin` takes replicas in turn (reason `round_robin`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from backends.pool.prefix_index import PrefixIndex
from backends.pool.replica import Replica
from backends.pool.settings import PoolFields

REASONS = ("prefix_hit", "cold", "imbalanced", "least_load", "round_robin")


@dataclass(frozen=True)
class Choice:
    replica: Replica
    reason: str  # one of REASONS
    matched_blocks: int = 0


class Policy(Protocol):
    name: str
    uses_prefixes: bool  # whether choose() needs the prompt's block hashes

    def choose(self, candidates: Sequence[Replica], hashes: list[int]) -> Choice: ...

    def forget(self, replica: str) -> None: ...


class RoundRobin:
    name = "round_robin"
    uses_prefixes = False

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, candidates: Sequence[Replica], hashes: list[int]) -> Choice:
        replica = candidates[self.turn % len(candidates)]
        self.turn += 1
        return Choice(replica, "round_robin")

    def forget(self, replica: str) -> None:
        return None


class LeastLoad:
    name = "least_load"
    uses_prefixes = False

    def __init__(self, stale_after: float) -> None:
        self.stale_after = stale_after
        self.turn = 0

    def key(self, replica: Replica) -> tuple[float, float, float]:
        return (replica.load(self.stale_after), replica.outstanding_tokens, replica.kv_usage(self.stale_after))

    def least(self, candidates: Sequence[Replica], first: dict[str, int] | None = None) -> Replica:
        """The least-loaded replica (after the `first` key, when given); among equals the next in
        turn, so idle replicas share the work."""
        keys = {r.id: ((first or {}).get(r.id, 0), *self.key(r)) for r in candidates}
        best = min(keys.values())
        ties = [r for r in candidates if keys[r.id] == best]
        self.turn += 1
        return ties[self.turn % len(ties)]

    def choose(self, candidates: Sequence[Replica], hashes: list[int]) -> Choice:
        return Choice(self.least(candidates), "least_load")

    def forget(self, replica: str) -> None:
        return None


class PrefixAware:
    name = "prefix"
    uses_prefixes = True

    def __init__(self, settings: PoolFields, index: PrefixIndex | None = None) -> None:
        self.settings = settings
        self.index = index or PrefixIndex(settings.prefix_capacity)
        self.loads = LeastLoad(settings.stale_seconds)
        self.listeners: list[Callable[[str, list[int]], None]] = []  # (replica, hashes) of each choice

    def imbalanced(self, candidates: Sequence[Replica]) -> bool:
        stale = self.settings.stale_seconds
        loads = {r.id: r.load(stale) for r in candidates}
        low, high = min(loads.values()), max(loads.values())
        if not (high - low > self.settings.balance_abs_threshold and high > self.settings.balance_rel_threshold * low):
            return False
        return any(r.queueing(stale) for r in candidates if loads[r.id] == high)

    def choose(self, candidates: Sequence[Replica], hashes: list[int]) -> Choice:
        choice = self._choose(candidates, hashes)
        self.index.insert(choice.replica.id, hashes)
        for listener in self.listeners:  # the other fronts of this gateway learn it too (gateway/serving/front_feed.py)
            listener(choice.replica.id, hashes)
        return choice

    def _choose(self, candidates: Sequence[Replica], hashes: list[int]) -> Choice:
        if len(candidates) > 1 and self.imbalanced(candidates):
            return Choice(self.loads.least(candidates), "imbalanced")
        if hashes:
            matched = self.index.match(hashes)
            best = max((matched.get(r.id, 0) for r in candidates), default=0)
            if best and best / len(hashes) >= self.settings.cache_threshold:
                holders = [r for r in candidates if matched.get(r.id, 0) == best]
                return Choice(self.loads.least(holders), "prefix_hit", best)
        held = {r.id: self.index.blocks(r.id) for r in candidates}
        fewest, margin = min(held.values()), len(hashes) / 2
        # within half this prompt of the fewest is level: prompts a block or two apart in length must not
        # send two cold prompts in a row to one replica while the other has room
        sizes = {key: fewest if blocks - fewest <= margin else blocks for key, blocks in held.items()}
        return Choice(self.loads.least(candidates, sizes), "cold")

    def forget(self, replica: str) -> None:
        self.index.forget(replica)


def make_policy(settings: PoolFields, index: PrefixIndex | None = None) -> Policy:
    if settings.balance == "round_robin":
        return RoundRobin()
    if settings.balance == "least_load":
        return LeastLoad(settings.stale_seconds)
    return PrefixAware(settings, index)
