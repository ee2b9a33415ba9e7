"""Rate limits and token budgets per API key, reserved before a generation and settled after it.

A generation reserves its prompt tokens plus its `max_new_tokens` (so concurrent requests cannot
overshoot a budget) and counts one request against RPM (once per HTTP request, however many
generations `n` makes). When it ends, the reservation settles to the tokens really used, however it
ended: finished, failed, or the client gone. The counts live in a Limiter: this process's, or Redis
shared by every replica.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math

from backends.base import GenerationRequest
from gateway.errors import GatewayError
from gateway.policy.auth import Principal
from gateway.store.limits import Limiter, LimiterUnavailable, LimitExceeded, Reservation

log = logging.getLogger("llmgw")
# one cell per HTTP request (set by the auth middleware): whether its request was counted against RPM yet
request_counted: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("request_counted", default=None)


def reserved_tokens(request: GenerationRequest) -> int:
    """Prompt tokens (counted, or estimated at 3 characters a token) plus the most it may generate."""
    if request.prompt_token_ids is not None:
        prompt = len(request.prompt_token_ids)
    else:
        text = request.prompt or "".join(m.content or "" for m in request.messages or [])
        prompt = math.ceil(len(text) / 3)
    return prompt + request.max_new_tokens


class Quota:
    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter
        self._settling: set[asyncio.Task[None]] = set()

    async def reserve(self, principal: Principal | None, request: GenerationRequest) -> Reservation | None:
        if principal is None or not principal.limits.limited:
            return None
        cell = request_counted.get()
        count = cell is None or not cell[0]
        try:
            reservation = await self.limiter.admit(principal.limits, reserved_tokens(request), count_request=count)
        except LimitExceeded as exc:
            raise GatewayError(str(exc), kind="rate_limited", code="rate_limit_exceeded",
                               headers={"retry-after": str(exc.retry_after_s)}) from None
        except LimiterUnavailable:
            raise GatewayError("rate limits cannot be checked now (the limit store is unreachable)",
                               kind="unavailable", code="limits_unavailable") from None
        if cell is not None:
            cell[0] = True
        return reservation

    def settle(self, reservation: Reservation | None, used: int) -> None:
        """Settle in the background: the response is not held up by the limit store."""
        if reservation is None or self.limiter.settle_at_once(reservation, used):
            return  # nothing to settle, or settled without I/O (a leased or local limit): no task
        task = asyncio.create_task(self._settle(reservation, used))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, reservation: Reservation, used: int) -> None:
        try:
            await self.limiter.settle(reservation, used)
        except Exception:
            log.exception("settling the token reservation of key %s failed", reservation.limits.key)

    async def aclose(self) -> None:
        await asyncio.gather(*self._settling, return_exceptions=True)
        await self.limiter.aclose()
