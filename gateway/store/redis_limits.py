"""The limiter shared by every gateway replica, in Redis: each admit and settle is one Lua script, so
check-and-take is atomic across replicas, and the scripts read Redis' own clock (TIME), so replica clocks do
not matter. Per key (the `{key}` hash tag keeps a key's data in one cluster slot):

    {prefix}:{key}:rpm, :tpm          HASH l (level), t (ms): token buckets; expire once they would be full
    {prefix}:{key}:d:20261204, :m:202612   HASH used, reserved, r:<id> (amount); expire 2 / 32 days
    ...:d:20261204:exp, ...               ZSET id -> expiry (ms): reservations dropped when a gateway never settles

Unreachable or slow Redis: fail_open admits unenforced (counted in status()), else LimiterUnavailable.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.store.limit_leases import Lease, lease_sizes
from gateway.store.limits import (
    PER_DAY,
    PER_MONTH,
    RPM,
    TPM,
    KeyLimits,
    LimiterUnavailable,
    LimitExceeded,
    Reservation,
    periods,
)
from gateway.store.redis_batch import ScriptBatcher

log = logging.getLogger(__name__)

COMMON_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function civil(days)  -- days since 1970-01-01 -> year, month, day (H. Hinnant's algorithm)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + math.floor((153 * mp + 2) / 5) + d - 1
  return era * 146097 + doe - 719468
end
local function bucket(k, cap)  -- the level refilled to now; a missing bucket is full
  local v = redis.call('HMGET', k, 'l', 't')
  local level, ts = tonumber(v[1]), tonumber(v[2])
  if not level then return cap end
  return math.min(cap, level + math.max(0, now - ts) * cap / 60000)
end
local function put_bucket(k, cap, level)
  redis.call('HSET', k, 'l', string.format('%.6f', level), 't', string.format('%d', now))
  redis.call('PEXPIRE', k, math.floor((cap - level) * 60000 / cap) + 60000)
end
local function keep(w, ttl) redis.call('EXPIRE', w, ttl); redis.call('EXPIRE', w .. ':exp', ttl) end
local DAY_TTL, MONTH_TTL = 2 * 86400, 32 * 86400
"""

# KEYS[1] base; ARGV id, amount, count_request, rpm, tpm, per day, per month ('' = none), ttl ms
# -> {admitted, refusing limit (1 rpm, 2 tpm, 3 day, 4 month), retry ms, day, month, expired}
ADMIT_LUA = COMMON_LUA + """
local base, id, amount, count = KEYS[1], ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local rpm, tpm, dlim, mlim = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local days = math.floor(now / 86400000)
local y, m, d = civil(days)
local day, month = string.format('%04d%02d%02d', y, m, d), string.format('%04d%02d', y, m)
local to_midnight = (days + 1) * 86400000 - now
local to_month = days_from_civil(m == 12 and y + 1 or y, m == 12 and 1 or m + 1, 1) * 86400000 - now
local expired = 0
local wins = {}
for _, w in ipairs({{dlim, base .. ':d:' .. day, 3, to_midnight}, {mlim, base .. ':m:' .. month, 4, to_month}}) do
  if w[1] then
    local ids = redis.call('ZRANGEBYSCORE', w[2] .. ':exp', '-inf', now)
    for _, rid in ipairs(ids) do
      local held = tonumber(redis.call('HGET', w[2], 'r:' .. rid))
      if held then
        redis.call('HDEL', w[2], 'r:' .. rid)
        redis.call('HINCRBY', w[2], 'reserved', -held)
        expired = expired + 1
      end
    end
    if #ids > 0 then redis.call('ZREMRANGEBYSCORE', w[2] .. ':exp', '-inf', now) end
    table.insert(wins, w)
  end
end
local function refuse(which, retry) return {0, which, math.ceil(retry), day, month, expired} end
local rl, tl
if rpm and count then
  rl = bucket(base .. ':rpm', rpm)
  if rl < 1 then return refuse(1, (1 - rl) * 60000 / math.max(rpm, 1)) end
end
if tpm then
  tl = bucket(base .. ':tpm', tpm)
  if tl < 1 then return refuse(2, (1 - tl) * 60000 / math.max(tpm, 1)) end
end
for _, w in ipairs(wins) do
  local v = redis.call('HMGET', w[2], 'used', 'reserved')
  if (tonumber(v[1]) or 0) + (tonumber(v[2]) or 0) + amount > w[1] then return refuse(w[3], w[4]) end
end
if rl then put_bucket(base .. ':rpm', rpm, rl - 1) end
if tl then put_bucket(base .. ':tpm', tpm, tl - amount) end
for _, w in ipairs(wins) do
  redis.call('HINCRBY', w[2], 'reserved', amount)
  redis.call('HSET', w[2], 'r:' .. id, amount)
  redis.call('ZADD', w[2] .. ':exp', now + tonumber(ARGV[8]), id)
  keep(w[2], w[3] == 3 and DAY_TTL or MONTH_TTL)
end
return {1, 0, 0, day, month, expired}
"""

# KEYS[1] base; ARGV id, amount, used, tpm ('' = none), day ('' = none), month ('' = none)
SETTLE_LUA = COMMON_LUA + """
local base, id, amount, used, tpm = KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
for _, w in ipairs({{ARGV[5], ':d:', DAY_TTL}, {ARGV[6], ':m:', MONTH_TTL}}) do
  if w[1] ~= '' then
    local win = base .. w[2] .. w[1]
    local held = tonumber(redis.call('HGET', win, 'r:' .. id))
    if held then  -- still held (not expired meanwhile)
      redis.call('HDEL', win, 'r:' .. id)
      redis.call('HINCRBY', win, 'reserved', -held)
      redis.call('ZREM', win .. ':exp', id)
    end
    redis.call('HINCRBY', win, 'used', used)
    keep(win, w[3])
  end
end
if tpm then put_bucket(base .. ':tpm', tpm, math.min(tpm, bucket(base .. ':tpm', tpm) + amount - used)) end
return 1
"""

# KEYS[1] base; ARGV rpm, tpm ('' = none), requests wanted, tokens wanted, tokens this request needs
# -> {1, requests granted, tokens granted} or {0, refusing limit (1 rpm, 2 tpm), retry ms}
LEASE_LUA = COMMON_LUA + """
local base, rpm, tpm = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local want_r, want_t, need_t = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local rl, tl
if rpm and want_r > 0 then
  rl = bucket(base .. ':rpm', rpm)
  if rl < 1 then return {0, 1, math.ceil((1 - rl) * 60000 / math.max(rpm, 1))} end
end
if tpm and want_t > 0 then
  tl = bucket(base .. ':tpm', tpm)
  if tl < 1 then return {0, 2, math.ceil((1 - tl) * 60000 / math.max(tpm, 1))} end
end
local gr, gt = 0, 0
if rl then gr = math.min(want_r, math.floor(rl)); put_bucket(base .. ':rpm', rpm, rl - gr) end
-- the tokens bucket may be overdrawn by the request at hand, as an admit does, never by the rest of a lease
if tl then gt = math.max(need_t, math.min(want_t, math.floor(tl))); put_bucket(base .. ':tpm', tpm, tl - gt) end
return {1, gr, gt}
"""

# KEYS[1] base; ARGV rpm, tpm ('' = none), requests back, tokens back: a lease's rest, back in the buckets
RETURN_LUA = COMMON_LUA + """
local base, rpm, tpm, r, t = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if rpm and r > 0 then put_bucket(base .. ':rpm', rpm, math.min(rpm, bucket(base .. ':rpm', rpm) + r)) end
if tpm and t > 0 then put_bucket(base .. ':tpm', tpm, math.min(tpm, bucket(base .. ':tpm', tpm) + t)) end
return 1
"""

WHAT = {1: RPM, 2: TPM, 3: PER_DAY, 4: PER_MONTH}
SETTLE_DELAY = 0.02  # settles wait this long to share a pipeline (a budget's reservation lasts that much longer)


def _arg(v: int | None) -> str:
    return "" if v is None else str(v)


class RedisLimiter:
    shared = True

    def __init__(self, url: str, fail_open: bool = True, reservation_ttl: float = 600.0, timeout: float = 0.5,
                 prefix: str = "llmgw", lease_fraction: float = 0.01) -> None:
        self.fail_open, self.reservation_ttl, self.timeout, self.prefix = fail_open, reservation_ttl, timeout, prefix
        self.lease_fraction = lease_fraction
        self._leases: dict[str, Lease] = {}  # by key name: this replica's shares of per-minute buckets
        self._ids = itertools.count()
        self._leasing: dict[str, asyncio.Lock] = {}  # one lease request per key at a time
        self._returning: set[asyncio.Task[None]] = set()
        # one retry on a fresh connection (a pooled one broken by a Redis restart), no backoff: fail fast
        self._redis = aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                              retry=Retry(NoBackoff(), 1))
        self._admits = ScriptBatcher(self._redis, timeout)
        self._settles = ScriptBatcher(self._redis, timeout, delay=SETTLE_DELAY)  # nobody waits on these
        self._admit = self._admits.register(ADMIT_LUA)
        self._lease = self._admits.register(LEASE_LUA)
        self._settle = self._settles.register(SETTLE_LUA)
        self._return = self._settles.register(RETURN_LUA)
        self._available, self._errors, self._unenforced, self._expired = True, 0, 0, 0

    def _base(self, key: str) -> str:
        return f"{self.prefix}:{{{key}}}"

    async def _run(self, batcher: ScriptBatcher, sha: str, keys: list[str], args: list[str]) -> Any:
        result = await batcher.call(sha, keys, args)
        self._available = True
        return result

    def _failed(self, what: str, exc: BaseException) -> None:
        self._errors += 1
        if self._available:
            log.warning("limiter: Redis unavailable (%s): %r", what, exc)
        self._available = False

    async def admit(self, limits: KeyLimits, amount: int, count_request: bool = True) -> Reservation:
        if not limits.limited:  # nothing to count: no round trip
            day, month, _, _ = periods(time.time())
            return Reservation(limits, amount, uuid.uuid4().hex, day, month)
        sizes = lease_sizes(limits, amount, self.lease_fraction)
        if sizes is not None:  # its id names no hold in Redis: a counter will do
            return await self._admit_leased(limits, amount, count_request, f"lease-{next(self._ids)}", sizes)
        rid = uuid.uuid4().hex
        args = [rid, str(amount), "1" if count_request else "0", _arg(limits.rpm), _arg(limits.tpm),
                _arg(limits.tokens_per_day), _arg(limits.tokens_per_month), str(int(self.reservation_ttl * 1000))]
        try:
            answer = await self._run(self._admits, self._admit, [self._base(limits.key)], args)
            ok, which, retry_ms, day, month, expired = answer
        except (RedisError, OSError, TimeoutError) as exc:
            return self._unreachable("admit", exc, limits, amount, rid)
        self._expired += int(expired)
        day, month = _text(day), _text(month)
        if not ok:
            raise self._exceeded(limits, int(which), int(retry_ms))
        return Reservation(limits, amount, rid, day, month)

    async def _admit_leased(self, limits: KeyLimits, amount: int, count_request: bool, rid: str,
                            sizes: tuple[int, int]) -> Reservation:
        day = month = ""  # leased keys have no day or month budget: no window is charged (no date work per request)
        lease = self._current_lease(limits)
        if lease.take(amount, count_request):  # the common case: no await at all
            return Reservation(limits, amount, rid, day, month, lease=lease)
        lock = self._leasing.setdefault(limits.key, asyncio.Lock())
        async with lock:  # concurrent requests of one key wait for one lease, then take from it
            lease = self._current_lease(limits)
            if lease.take(amount, count_request):
                return Reservation(limits, amount, rid, day, month, lease=lease)
            short_requests, short_tokens = lease.shortfall(amount, count_request)
            args = [_arg(limits.rpm), _arg(limits.tpm), str(sizes[0] if short_requests else 0),
                    str(max(sizes[1], short_tokens) if short_tokens else 0), str(short_tokens)]
            try:
                ok, *granted = await self._run(self._admits, self._lease, [self._base(limits.key)], args)
            except (RedisError, OSError, TimeoutError) as exc:
                return self._unreachable("lease", exc, limits, amount, rid)
            if not ok:
                raise self._exceeded(limits, int(granted[0]), int(granted[1]))
            lease.requests += int(granted[0])
            lease.tokens += int(granted[1])
            taken = lease.take(amount, count_request)
            assert taken, "a lease grants at least what the request lacks"
            return Reservation(limits, amount, rid, day, month, lease=lease)

    def _current_lease(self, limits: KeyLimits) -> Lease:
        """This key's lease, a fresh one when the last is a second old or its limits changed."""
        now = time.monotonic()
        lease = self._leases.get(limits.key)
        if lease is None or not lease.usable(limits, now):
            if lease is not None:
                self._give_back(lease)
            lease = self._leases[limits.key] = Lease(limits, now)
        return lease

    def _give_back(self, lease: Lease) -> None:
        lease.returned = True
        if lease.requests <= 0 and lease.tokens <= 0:
            return
        task = asyncio.get_running_loop().create_task(self._return_rest(lease))
        self._returning.add(task)
        task.add_done_callback(self._returning.discard)

    async def _return_rest(self, lease: Lease) -> None:
        limits = lease.limits
        args = [_arg(limits.rpm), _arg(limits.tpm), str(max(0, lease.requests)), str(max(0, lease.tokens))]
        try:
            await self._run(self._settles, self._return, [self._base(limits.key)], args)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("lease return", exc)

    def _unreachable(self, what: str, exc: BaseException, limits: KeyLimits, amount: int, rid: str) -> Reservation:
        self._failed(what, exc)
        if not self.fail_open:
            raise LimiterUnavailable(f"rate limiter store unreachable: {exc!r}") from exc
        self._unenforced += 1
        day, month, _, _ = periods(time.time())
        return Reservation(limits, amount, rid, day, month, enforced=False)

    @staticmethod
    def _exceeded(limits: KeyLimits, which: int, retry_ms: int) -> LimitExceeded:
        what = WHAT[which]
        limit = {RPM: limits.rpm, TPM: limits.tpm, PER_DAY: limits.tokens_per_day,
                 PER_MONTH: limits.tokens_per_month}[what]
        return LimitExceeded(what, limit or 0, retry_ms / 1000, limits.key)

    async def settle(self, reservation: Reservation, used: int) -> None:
        """Once per reservation. An unenforced one (admitted while Redis was down) records `used` in the
        windows and the tpm bucket if Redis is back, as if nothing had been reserved."""
        if self.settle_at_once(reservation, used):
            return
        reservation.settled = True
        limits = reservation.limits
        amount = reservation.amount if reservation.enforced else 0
        args = [reservation.id, str(amount), str(used), _arg(limits.tpm),
                reservation.day if limits.tokens_per_day is not None else "",
                reservation.month if limits.tokens_per_month is not None else ""]
        try:
            await self._run(self._settles, self._settle, [self._base(limits.key)], args)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("settle", exc)

    def settle_at_once(self, reservation: Reservation, used: int) -> bool:
        """Nothing to count (no tpm, no budget), or a leased reservation: settled here, without Redis."""
        if reservation.settled:
            return True
        limits = reservation.limits
        if not (limits.tpm is not None or limits.tokens_per_day is not None or limits.tokens_per_month is not None):
            reservation.settled = True
            return True
        if reservation.lease is not None and reservation.lease.refund(reservation.amount - used):
            reservation.settled = True  # back into this replica's share; it reaches Redis with the lease's rest
            return True
        return False

    def seed(self, key: str, day_used: int, month_used: int) -> None:
        """Nothing to do: the counts live in Redis and survive gateway restarts."""

    def status(self) -> dict[str, object]:
        return {"shared": True, "available": self._available, "errors": self._errors,
                "unenforced": self._unenforced, "expired_reservations": self._expired}

    async def aclose(self) -> None:
        for lease in self._leases.values():
            self._give_back(lease)
        self._leases.clear()
        await asyncio.gather(*self._returning, return_exceptions=True)
        await self._redis.aclose()


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
