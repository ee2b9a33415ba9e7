"""The pool's balancing policies, prefix index and load-signal parsers, on their own (no servers):
round robin, least load, the prefix rule and its imbalance gate, bounded LRU memory, staleness,
and the figures parsed from recorded vLLM, TGI and gateway /metrics bodies."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from backends.base import ChatMessage, GenerationRequest
from backends.pool.balance import LeastLoad, PrefixAware, RoundRobin, make_policy
from backends.pool.prefix_index import PrefixIndex, request_block_hashes, text_block_hashes, token_block_hashes
from backends.pool.replica import Replica
from backends.pool.settings import PoolFields
from backends.pool.signals import ReplicaSignals, parse_metrics
from gateway.config import ConfigError, parse_config

RECORDINGS = Path(__file__).parent / "recordings_metrics"


def replicas(n: int) -> list[Replica]:
    # the policies read only the replicas' bookkeeping and signals, never their backends
    return [Replica(f"http://10.0.0.{i}:8000", backend=None, started=True) for i in range(n)]  # type: ignore[arg-type]


def hashes(text: str) -> list[int]:
    return text_block_hashes(text, 64, 256)


def prompt(group: int, question: int) -> str:
    shared = f"You are assistant number {group}. " * 40  # about 1,300 characters: 20 blocks
    return shared + f"Question {question}: what is {question} times {group}?"


# the prefix index


def test_block_hashes_are_chained_so_equal_hashes_mean_equal_prefixes() -> None:
    a, b = hashes("x" * 64 + "y" * 64 + "z" * 64), hashes("x" * 64 + "y" * 64 + "w" * 64)
    assert a[:2] == b[:2] and a[2] != b[2]
    c = hashes("q" * 64 + "y" * 64 + "z" * 64)  # the same second block after another first one
    assert not set(a) & set(c)


def test_only_full_blocks_are_hashed_as_an_engine_caches_only_full_blocks() -> None:
    assert token_block_hashes(list(range(31)), 16, 256) == token_block_hashes(list(range(16)), 16, 256)
    assert len(token_block_hashes(list(range(32)), 16, 256)) == 2
    assert token_block_hashes(list(range(15)), 16, 256) == []
    assert len(token_block_hashes(list(range(10_000)), 16, 256)) == 256  # bounded work per prompt


def test_a_request_is_keyed_by_its_token_ids_else_its_text_else_its_messages() -> None:
    by_tokens = GenerationRequest(request_id="a", model="m", prompt="whatever", prompt_token_ids=list(range(64)))
    assert request_block_hashes(by_tokens, 16, 64, 256) == token_block_hashes(list(range(64)), 16, 256)
    chat = [ChatMessage(role="system", content="s" * 200), ChatMessage(role="user", content="hi")]
    longer = [*chat, ChatMessage(role="assistant", content="hello"), ChatMessage(role="user", content="u" * 100)]
    first = request_block_hashes(GenerationRequest(request_id="b", model="m", messages=chat), 16, 64, 256)
    second = request_block_hashes(GenerationRequest(request_id="c", model="m", messages=longer), 16, 64, 256)
    assert first and second[:len(first) - 1] == first[:-1]  # a conversation's next turn extends its prefix


def test_match_counts_leading_blocks_held_in_a_row() -> None:
    index = PrefixIndex(capacity=100)
    a = hashes(prompt(1, 1))
    index.insert("r0", a[:5])
    index.insert("r1", a)
    assert index.match(a) == {"r0": 5, "r1": len(a)}
    assert index.match(hashes(prompt(2, 1))) == {}


def test_memory_is_bounded_per_replica_and_least_recently_used_blocks_go_first() -> None:
    index = PrefixIndex(capacity=30)
    old, new = hashes(prompt(1, 1)), hashes(prompt(2, 1))
    index.insert("r0", old)
    index.insert("r0", new)
    assert index.blocks("r0") == 30
    assert index.match(new) == {"r0": len(new)}  # the newest prompt is kept whole
    assert index.match(old) == {}  # the oldest's first blocks went first
    assert len(index.holders) == 30


def test_a_replica_that_leaves_is_forgotten() -> None:
    index = PrefixIndex(capacity=100)
    a = hashes(prompt(1, 1))
    index.insert("r0", a)
    index.insert("r1", a)
    index.forget("r0")
    assert index.match(a) == {"r1": len(a)} and index.blocks("r0") == 0


# the policies


def test_round_robin_takes_replicas_in_turn() -> None:
    pool = replicas(3)
    policy = RoundRobin()
    picks = Counter(policy.choose(pool, []).replica.id for _ in range(30))
    assert set(picks.values()) == {10}


def test_least_load_avoids_the_busy_replica_and_shares_among_idle_ones() -> None:
    pool = replicas(3)
    policy = LeastLoad(stale_after=3.0)
    pool[0].in_flight = 5
    picks = Counter(policy.choose(pool, []).replica.id for _ in range(10))
    assert pool[0].id not in picks and set(picks.values()) == {5}
    pool[1].in_flight, pool[2].in_flight = 6, 7
    assert policy.choose(pool, []).replica is pool[0]


def test_least_load_reads_fresh_reports_and_ignores_stale_ones() -> None:
    pool = replicas(2)
    policy = LeastLoad(stale_after=3.0)
    pool[0].signals = ReplicaSignals(waiting=4, running=8, at=time.monotonic())  # other gateways' load
    assert policy.choose(pool, []).replica is pool[1]
    pool[0].signals = ReplicaSignals(waiting=4, running=8, at=time.monotonic() - 10)  # stale
    pool[1].in_flight = 1
    assert policy.choose(pool, []).replica is pool[0]


def test_prefix_policy_keeps_each_shared_prefix_on_one_replica_and_spreads_the_groups() -> None:
    pool = replicas(2)
    policy = PrefixAware(PoolFields())
    homes: dict[int, set[str]] = {}
    reasons = Counter()
    for question in range(6):
        for group in range(4):
            choice = policy.choose(pool, hashes(prompt(group, question)))
            homes.setdefault(group, set()).add(choice.replica.id)
            reasons[choice.reason] += 1
    assert all(len(h) == 1 for h in homes.values())  # every group always on the same replica
    assert Counter(next(iter(h)) for h in homes.values()) == Counter({pool[0].id: 2, pool[1].id: 2})
    assert reasons == Counter({"cold": 4, "prefix_hit": 20})


def test_imbalanced_load_overrides_prefix_affinity() -> None:
    pool = replicas(2)
    policy = PrefixAware(PoolFields(balance_abs_threshold=8, balance_rel_threshold=1.5))
    home = policy.choose(pool, hashes(prompt(1, 0))).replica
    other = pool[1] if home is pool[0] else pool[0]
    home.in_flight = 8  # 8 - 0 is not over 8: still affinity
    assert policy.choose(pool, hashes(prompt(1, 1))).reason == "prefix_hit"
    home.in_flight = 9
    choice = policy.choose(pool, hashes(prompt(1, 2)))
    assert (choice.replica, choice.reason) == (other, "imbalanced")
    other.in_flight = 7  # 9 vs 7: a difference of 2, not imbalanced
    assert policy.choose(pool, hashes(prompt(1, 3))).reason == "prefix_hit"


def test_a_replica_reporting_no_waiting_requests_keeps_its_prefix_hits_however_many_run() -> None:
    """Running requests share the replica's batch; only a queue there makes a cold prefill elsewhere worth it."""
    pool = replicas(2)
    policy = PrefixAware(PoolFields(balance_abs_threshold=8, balance_rel_threshold=1.5))
    home = policy.choose(pool, hashes(prompt(1, 0))).replica
    other = pool[1] if home is pool[0] else pool[0]
    home.in_flight = 12
    home.signals = ReplicaSignals(waiting=0, running=12, at=time.monotonic())
    assert policy.choose(pool, hashes(prompt(1, 1))).reason == "prefix_hit"
    home.signals = ReplicaSignals(waiting=2, running=12, at=time.monotonic())  # now it queues
    choice = policy.choose(pool, hashes(prompt(1, 2)))
    assert (choice.replica, choice.reason) == (other, "imbalanced")
    home.signals = ReplicaSignals(waiting=0, running=12, at=time.monotonic() - 10)  # stale: the counts decide
    assert policy.choose(pool, hashes(prompt(1, 3))).reason == "imbalanced"


def test_a_short_match_is_cold_and_goes_to_the_replica_holding_fewer_blocks() -> None:
    pool = replicas(2)
    policy = PrefixAware(PoolFields(cache_threshold=0.5))
    common = "c" * 128  # two blocks in common, then each prompt its own eight
    first = policy.choose(pool, hashes(common + "a" * 512)).replica
    choice = policy.choose(pool, hashes(common + "b" * 512))
    assert choice.reason == "cold" and choice.replica is not first


def test_new_prefix_groups_split_evenly_even_when_the_emptier_replica_is_busier_by_one() -> None:
    """A cold prompt's followers go where it went, so a load difference of one request at that moment
    must not decide where a whole group lives: the replica holding fewer blocks takes it."""
    pool = replicas(2)
    policy = PrefixAware(PoolFields())
    homes: dict[int, str] = {}
    for group in range(8):
        groups_held = Counter(homes.values())
        emptier = min(pool, key=lambda r: groups_held[r.id])
        for replica in pool:  # the replica with fewer groups has one request more in flight
            replica.in_flight = 1 if replica is emptier else 0
        choice = policy.choose(pool, hashes(prompt(group, 0)))
        assert choice.reason == "cold"
        homes[group] = choice.replica.id
        for question in range(1, 3):
            assert policy.choose(pool, hashes(prompt(group, question))).replica.id == homes[group]
    assert Counter(homes.values()) == Counter({pool[0].id: 4, pool[1].id: 4})
    idle = next(r for r in pool if r is not emptier)
    assert policy.choose(pool, hashes(prompt(9, 0))).replica is idle  # equal blocks held: load decides


def test_unrelated_prompts_alternate_even_when_their_lengths_differ_by_a_block() -> None:
    """Blocks held differ by a block or two between replicas after unrelated prompts of near-equal length:
    that is level, and the next cold prompt goes by load, then in turn, not twice in a row to one replica."""
    pool = replicas(2)
    policy = PrefixAware(PoolFields())
    picks = []
    for i in range(12):
        prompt_text = f"{i:04d}" * (16 * 20 + 16 * (i % 3))  # 20 to 22 blocks of 64 characters, nothing shared
        choice = policy.choose(pool, hashes(prompt_text))
        assert choice.reason == "cold"
        picks.append(choice.replica.id)
    assert all(a != b for a, b in zip(picks, picks[1:])), picks


def test_make_policy_follows_the_setting() -> None:
    assert isinstance(make_policy(PoolFields(balance="round_robin")), RoundRobin)
    assert isinstance(make_policy(PoolFields(balance="least_load")), LeastLoad)
    assert isinstance(make_policy(PoolFields()), PrefixAware)  # the default


# signals


def test_vllm_metrics_parse_from_a_recorded_body() -> None:
    signals = parse_metrics((RECORDINGS / "vllm.txt").read_text())
    assert signals.running is not None and signals.running >= 1
    assert signals.waiting is not None
    assert signals.kv_usage is not None and 0 < signals.kv_usage <= 1


def test_tgi_metrics_parse_from_a_recorded_body() -> None:
    signals = parse_metrics((RECORDINGS / "tgi.txt").read_text())
    assert (signals.waiting, signals.running, signals.kv_usage) == (0, 0, None)  # TGI reports no KV usage


def test_the_gateways_own_engine_metrics_parse_from_a_recorded_body() -> None:
    signals = parse_metrics((RECORDINGS / "llmgw.txt").read_text())
    assert signals.running is not None and signals.running >= 1
    assert signals.waiting is not None and signals.kv_usage is not None and 0 < signals.kv_usage <= 1


def test_vllms_old_kv_metric_name_is_read_too() -> None:
    text = ("# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage.\n# TYPE vllm:gpu_cache_usage_perc gauge\n"
            'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n')
    assert parse_metrics(text).kv_usage == 0.25


# config


def pool_config(backend: str) -> str:
    return f'[backends.v]\ntype = "openai"\nmodel = "m"\n{backend}\n\n[models.m]\nbackend = "v"\n'


@pytest.mark.parametrize(("table", "message"), [
    ('base_url = "http://a:1"\nendpoints = ["http://b:1"]', "not both"),
    ('model_x = 1', "unknown key"),
    ('endpoints = ["http://a:1", "http://a:1"]', "twice"),
    ('discovery = "dns"\nendpoints = ["http://a:1"]', "resolves"),
    ('endpoints = ["http://a:1"]\nbalance = "random"', "balance"),
    ('endpoints = ["http://a:1"]\ncache_threshold = 2.0', "cache_threshold"),
    ('', "required"),
])
def test_bad_pool_settings_fail_the_config_at_the_backends_table(table: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        parse_config(pool_config(table))
    assert str(error.value).startswith("backends.v")


def test_a_pool_config_is_accepted_for_every_http_backend_type() -> None:
    for kind, extra in (("openai", 'model = "m"\n'), ("tgi", ""), ("triton", "")):
        text = (f'[backends.p]\ntype = "{kind}"\n{extra}endpoints = ["http://a:1", "http://b:1"]\n'
                f'balance = "least_load"\nscrape_interval = 0.5\n\n[models.m]\nbackend = "p"\n')
        settings: Any = parse_config(text).backends["p"].settings
        assert settings.is_pool and settings.endpoints == ["http://a:1", "http://b:1"]


def test_a_replicas_metrics_may_be_scraped_on_another_port() -> None:
    from backends.pool.signals import metrics_url

    assert metrics_url("http://10.0.0.7:8000", "/metrics", 8002) == "http://10.0.0.7:8002/metrics"  # Triton
    assert metrics_url("http://[fd00::7]:8000", "/metrics") == "http://[fd00::7]:8000/metrics"
