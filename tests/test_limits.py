"""Rate limits and token budgets: the in-process limiter, and the Redis one against a real redis-server shared by
two limiter instances (two gateway replicas). No wall-clock asserts: buckets refill far slower than the tests run."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis

from gateway.store.limits import (
    KeyLimits,
    LimiterUnavailable,
    LimitExceeded,
    LocalLimiter,
    Reservation,
    make_limiter,
    periods,
)
from gateway.store.redis_limits import COMMON_LUA, RedisLimiter
from tests.services import free_port, have_redis, redis_server

pytestmark = pytest.mark.skipif(not have_redis(), reason="redis-server not installed (deploy/ci/setup.sh installs it)")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture(params=["local", "redis"])
async def replicas(request: pytest.FixtureRequest) -> AsyncIterator[tuple[object, object]]:
    """Two limiters sharing counts: two Redis clients, or one local limiter twice."""
    if request.param == "local":
        local = LocalLimiter()
        yield local, local
        return
    url = request.getfixturevalue("redis_url")
    a, b = RedisLimiter(url, timeout=5), RedisLimiter(url, timeout=5)
    yield a, b
    assert a.status()["unenforced"] == b.status()["unenforced"] == 0
    await a.aclose()
    await b.aclose()


def key() -> str:
    return f"team-{uuid.uuid4().hex[:8]}"


async def outcomes(calls: list) -> tuple[list[Reservation], list[LimitExceeded]]:
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        if not isinstance(r, Reservation | LimitExceeded):
            raise r
    return [r for r in results if isinstance(r, Reservation)], [r for r in results if isinstance(r, LimitExceeded)]


@pytest.mark.parametrize("used", [100, 60])
async def test_day_budget_is_strict_under_concurrency(replicas: tuple, used: int) -> None:
    a, b = replicas
    limits = KeyLimits(key(), tokens_per_day=500)  # exactly five reservations of 100
    admitted, refused = await outcomes([(a if i % 2 else b).admit(limits, 100) for i in range(20)])
    assert len(admitted) == 5 and len(refused) == 15
    assert all(r.enforced for r in admitted)
    e = refused[0]
    assert e.what == "tokens per day" and e.limit == 500 and 0 < e.retry_after <= 86400
    assert str(e) == f"rate limit reached for API key '{limits.key}': 500 tokens per day"
    await asyncio.gather(*[(a if i % 2 else b).settle(r, used) for i, r in enumerate(admitted)])
    room = (500 - 5 * used) // 100  # 0 when every reservation was used in full
    admitted, refused = await outcomes([a.admit(limits, 100) for _ in range(room + 3)])
    assert len(admitted) == room and len(refused) == 3


async def test_month_budget_and_unlimited_windows(replicas: tuple) -> None:
    a, b = replicas
    limits = KeyLimits(key(), tokens_per_day=10_000, tokens_per_month=250)
    await a.admit(limits, 200)
    with pytest.raises(LimitExceeded) as e:
        await b.admit(limits, 100)
    assert e.value.what == "tokens per month" and e.value.retry_after_s >= 1
    free = await b.admit(KeyLimits(limits.key), 10**9)  # no limits set: nothing counted
    assert free.enforced and not KeyLimits(limits.key).limited and limits.limited


async def test_rpm_counts_across_replicas(replicas: tuple) -> None:
    a, b = replicas
    limits = KeyLimits(key(), rpm=3)
    await a.admit(limits, 10)
    await b.admit(limits, 10)
    await a.admit(limits, 10, count_request=False)  # e.g. a retry of the same request: not counted
    await a.admit(limits, 10)
    with pytest.raises(LimitExceeded) as e:
        await b.admit(limits, 10)
    assert e.value.what == "requests per minute" and e.value.limit == 3 and e.value.retry_after > 0


async def test_tpm_overdraws_then_settle_refunds(replicas: tuple) -> None:
    a, b = replicas
    limits = KeyLimits(key(), tpm=100)
    big = await a.admit(limits, 150)  # the bucket is positive: admitted, and overdrawn to -50
    with pytest.raises(LimitExceeded) as e:
        await b.admit(limits, 1)
    assert e.value.what == "tokens per minute" and e.value.retry_after > 0
    await b.settle(big, 10)  # 140 back (capped at the capacity): about +90
    await b.settle(big, 10)  # idempotent
    assert big.settled
    await a.admit(limits, 80)
    await a.admit(limits, 80)  # still positive (about 10) before this one
    with pytest.raises(LimitExceeded):
        await b.admit(limits, 1)


async def test_reservation_days_are_utc(replicas: tuple) -> None:
    before = datetime.now(UTC)
    r = await replicas[0].admit(KeyLimits(key(), tokens_per_day=10), 1)
    after = datetime.now(UTC)
    assert r.day in {before.strftime("%Y%m%d"), after.strftime("%Y%m%d")}
    assert r.month in {before.strftime("%Y%m"), after.strftime("%Y%m")}
    assert len(r.id) == 32


async def test_expired_reservations_stop_counting(redis_url: str) -> None:
    for limiter in (LocalLimiter(reservation_ttl=0.05), RedisLimiter(redis_url, reservation_ttl=0.05, timeout=5)):
        limits = KeyLimits(key(), tokens_per_day=100, tokens_per_month=100)
        await limiter.admit(limits, 100)  # never settled: its gateway died
        await asyncio.sleep(0.3)
        again = await limiter.admit(limits, 100)
        assert limiter.status()["expired_reservations"] == 2  # one each in the day and month windows
        await limiter.settle(again, 100)
        with pytest.raises(LimitExceeded):
            await limiter.admit(limits, 1)
        await limiter.aclose()


async def test_fail_open_and_recovery(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        lenient, strict = RedisLimiter(server.url, timeout=2), RedisLimiter(server.url, fail_open=False, timeout=2)
        limits = KeyLimits(key(), rpm=100, tokens_per_day=500)
        assert (await lenient.admit(limits, 100)).enforced and (await strict.admit(limits, 100)).enforced
        server.stop()
        down = await lenient.admit(limits, 100)
        assert not down.enforced and down.day == periods(datetime.now(UTC).timestamp())[0]
        assert lenient.status() == {"shared": True, "available": False, "errors": 1, "unenforced": 1,
                                    "expired_reservations": 0}
        with pytest.raises(LimiterUnavailable):
            await strict.admit(limits, 100)
        await strict.settle(Reservation(limits, 5, "x", down.day, down.month), 5)  # logged and counted only
        assert strict.status()["errors"] == 2 and not strict.status()["available"]
        server.start()  # empty again (no persistence), scripts flushed: reloaded on NOSCRIPT
        await lenient.settle(down, 450)  # recorded now that Redis is back
        assert lenient.status()["available"]
        with pytest.raises(LimitExceeded):
            await strict.admit(limits, 100)
        assert (await strict.admit(limits, 50)).enforced and strict.status()["available"]
        await lenient.aclose()
        await strict.aclose()


async def test_hung_redis_times_out(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        limiter, limits = RedisLimiter(server.url, timeout=1), KeyLimits(key(), rpm=100)
        assert (await limiter.admit(limits, 1)).enforced
        server.pause()
        try:
            r = await asyncio.wait_for(limiter.admit(limits, 1), 60)  # the socket timeout, not this, ends it
            assert not r.enforced and not limiter.status()["available"]
        finally:
            server.resume()
        assert (await limiter.admit(limits, 1)).enforced and limiter.status()["available"]
        await limiter.aclose()


async def test_unreachable_from_the_start() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    limiter = RedisLimiter(url, timeout=2)
    r = await limiter.admit(KeyLimits("k", rpm=1), 10)
    assert not r.enforced and limiter.status()["unenforced"] == 1
    await limiter.settle(r, 10)
    with pytest.raises(LimiterUnavailable):
        await RedisLimiter(url, fail_open=False, timeout=2).admit(KeyLimits("k", rpm=1), 10)
    await limiter.aclose()


async def test_local_seed_and_new_day() -> None:
    now = [datetime(2026, 12, 31, 23, 0, tzinfo=UTC).timestamp()]
    limiter = LocalLimiter(clock=lambda: now[0])
    limits = KeyLimits("team-a", tokens_per_day=1000, tokens_per_month=5000)
    limiter.seed("team-a", day_used=950, month_used=4000)
    await limiter.admit(limits, 50)
    with pytest.raises(LimitExceeded) as e:
        await limiter.admit(limits, 1)
    assert e.value.what == "tokens per day" and e.value.retry_after == 3600
    now[0] += 3600  # a new day, month and year
    r = await limiter.admit(limits, 1000)
    assert (r.day, r.month) == ("20270101", "202701")
    assert limiter.status() == {"shared": False, "available": True, "errors": 0, "unenforced": 0,
                                "expired_reservations": 0}


def test_make_limiter(redis_url: str) -> None:
    assert isinstance(make_limiter(None), LocalLimiter) and not make_limiter("").shared
    assert isinstance(make_limiter(redis_url, fail_open=False), RedisLimiter)


def test_lua_calendar_matches_python(redis_url: str) -> None:
    """The scripts compute UTC days and months from Redis' clock: check the arithmetic over leap years and
    month ends against Python's."""
    rng = random.Random(0)
    stamps = [int(datetime(y, m, d, tzinfo=UTC).timestamp()) + s for y in (1999, 2000, 2024, 2026, 2100)
              for m, d in ((1, 1), (2, 28), (2, 28 + (y % 4 == 0 and (y % 100 != 0 or y % 400 == 0))), (12, 31))
              for s in (-1, 0, 86399)] + [rng.randrange(0, 4_102_444_800) for _ in range(300)]
    script = COMMON_LUA + """
local out = {}
for i, a in ipairs(ARGV) do
  local days = math.floor(tonumber(a) / 86400)
  local y, m, d = civil(days)
  assert(days_from_civil(y, m, d) == days)
  out[i] = string.format('%04d%02d%02d', y, m, d)
end
return out
"""
    client = redis.Redis.from_url(redis_url)
    got = [v.decode() for v in client.eval(script, 0, *stamps)]
    client.close()
    want = [(datetime(1970, 1, 1, tzinfo=UTC) + timedelta(seconds=s)).strftime("%Y%m%d") for s in stamps]
    assert got == want


async def test_leased_per_minute_limits_admit_no_more_than_the_limit_across_replicas(redis_url: str) -> None:
    """Busy keys admit from a share taken out of Redis: two replicas together still stop at the limit."""
    a, b = RedisLimiter(redis_url, timeout=5), RedisLimiter(redis_url, timeout=5)  # 1% leases
    limits = KeyLimits(key(), rpm=2000)  # leases of 20 requests
    started = time.monotonic()
    admitted, refused = await outcomes([(a if i % 3 else b).admit(limits, 10) for i in range(2100)])
    refilled = (time.monotonic() - started) * 2000 / 60  # the bucket refills while the admissions run
    assert 1980 <= len(admitted) <= 2000 + refilled + 2  # at most the limit, plus what refilled
    assert all(r.enforced and r.lease is not None for r in admitted)
    assert refused[0].what == "requests per minute" and refused[0].retry_after > 0
    probe = redis.Redis.from_url(redis_url)
    level = float(probe.hget(f"llmgw:{{{limits.key}}}:rpm", "l"))
    await a.aclose()  # what a replica still holds goes back to the bucket
    await b.aclose()
    assert float(probe.hget(f"llmgw:{{{limits.key}}}:rpm", "l")) >= level
    probe.close()


async def test_leased_tokens_are_refunded_and_returned_to_the_shared_bucket(redis_url: str) -> None:
    a, b = RedisLimiter(redis_url, timeout=5), RedisLimiter(redis_url, timeout=5)
    limits = KeyLimits(key(), tpm=100_000)  # leases of 1000 tokens
    first = await a.admit(limits, 300)
    assert first.lease is not None and first.lease.tokens == 700
    await a.settle(first, 100)  # 200 unused: back into a's share
    assert first.lease.tokens == 900
    second = await a.admit(limits, 900)  # from the share, no lease taken
    assert second.lease is first.lease and first.lease.tokens == 0
    await a.aclose()  # a held nothing more
    # b cannot take more than the bucket has: 100k - 1000 (a's lease) + 200 unused, about 99.2k
    got = 0
    while True:
        try:
            await b.admit(limits, 900)
        except LimitExceeded as exc:
            assert exc.what == "tokens per minute"
            break
        got += 900
    assert 99_000 <= got <= 100_000 + 900  # the last admit may overdraw the bucket, as an exact admit does
    await b.aclose()


async def test_tight_limits_and_budgets_never_lease(redis_url: str) -> None:
    limiter = RedisLimiter(redis_url, timeout=5)
    for limits in (KeyLimits(key(), rpm=500),  # 1% is 5 requests: too small a lease
                   KeyLimits(key(), tpm=10_000),  # 1% is 100 tokens, less than the request's 300
                   KeyLimits(key(), rpm=100_000, tokens_per_day=10**9)):  # a budget: every request exact
        assert (await limiter.admit(limits, 300)).lease is None
    off = RedisLimiter(redis_url, timeout=5, lease_fraction=0)
    assert (await off.admit(KeyLimits(key(), rpm=100_000), 1)).lease is None
    await limiter.aclose()
    await off.aclose()


async def test_a_lease_request_while_redis_is_down_fails_open_or_closed(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        lenient, strict = RedisLimiter(server.url, timeout=2), RedisLimiter(server.url, fail_open=False, timeout=2)
        limits = KeyLimits(key(), rpm=10_000)
        server.stop()
        assert not (await lenient.admit(limits, 1)).enforced and lenient.status()["unenforced"] == 1
        with pytest.raises(LimiterUnavailable):
            await strict.admit(limits, 1)
        server.start()
        assert (await strict.admit(limits, 1)).lease is not None
        await lenient.aclose()
        await strict.aclose()
