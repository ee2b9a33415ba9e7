"""The state store of a fleet: two gateway processes on one Postgres and one Redis (real servers,
started by the tests). A token budget holds across both under concurrency, request rates are shared,
key changes reach the other replica, and a Postgres outage loses no usage row."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import asyncpg
import httpx
import pytest

from tests.recordings import openai_text_routes
from tests.server import CLIENT_TIMEOUT, running_gateway, wait_until
from tests.services import PostgresServer, RedisServer, have_postgres, have_redis, postgres_server, redis_server
from tests.upstream import Hold, ScriptedUpstream, scripted_upstream

pytestmark = pytest.mark.skipif(not (have_postgres() and have_redis()),
                                reason="needs Debian's postgresql and redis-server (.ci/run installs them)")
ADMIN = "admin-secret-0123456789"
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}
MAX_TOKENS = 100
BUDGET = 5 * MAX_TOKENS + 20  # five reservations of a short prompt + 100 tokens fit; a sixth does not


def config(upstream: ScriptedUpstream, database: str, redis: str | None) -> str:
    shared = f'redis = "{redis}"\n' if redis else ""
    return (f'[backends.up]\ntype = "openai"\nbase_url = "{upstream.url}"\nmodel = "m"\n[models.m]\nbackend = "up"\n'
            f'[server]\nadmin_key = "{ADMIN}"\nhealth_check_interval = 60\nmetrics_per_key = true\nmax_key_series = 3\n'
            f'[state]\ndatabase = "{database}"\n{shared}key_refresh_interval = 0.5\nusage_flush_interval = 0.2\n')


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def create_key(url: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/admin/keys", json=body, headers=ADMIN_HEADERS, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 201, r.text
    return r.json()


def knows(url: str, secret: str) -> bool:
    return httpx.get(f"{url}/v1/models", headers=bearer(secret), timeout=CLIENT_TIMEOUT).status_code == 200


def send(url: str, door: str, secret: str) -> httpx.Response:
    """One generation of at most MAX_TOKENS through a door: OpenAI chat, Anthropic messages or TGI."""
    if door == "openai":
        path, body = "/v1/chat/completions", {"model": "m", "max_tokens": MAX_TOKENS,
                                              "messages": [{"role": "user", "content": "Hi"}]}
    elif door == "anthropic":
        path, body = "/v1/messages", {"model": "m", "max_tokens": MAX_TOKENS,
                                      "messages": [{"role": "user", "content": "Hi"}]}
    else:
        path, body = "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": MAX_TOKENS}}
    return httpx.post(f"{url}{path}", json=body, headers=bearer(secret), timeout=CLIENT_TIMEOUT)


def is_protocol_429(door: str, r: httpx.Response) -> bool:
    body = r.json()
    if r.status_code != 429 or not r.headers.get("retry-after"):
        return False
    if door == "openai":
        return body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "rate_limit_exceeded"
    if door == "anthropic":
        return body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    return body["error_type"] == "rate_limited" and "tokens per day" in body["error"]


def usage_count(database: str, key: str) -> int:
    async def count() -> int:
        conn = await asyncpg.connect(database)
        try:
            return int(await conn.fetchval("SELECT count(*) FROM usage WHERE key_name = $1", key))
        finally:
            await conn.close()

    return asyncio.run(count())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fleet")
    gate = Hold()
    gate.open()
    with ExitStack() as stack:
        pg: PostgresServer = stack.enter_context(postgres_server(tmp))
        redis: RedisServer = stack.enter_context(redis_server(tmp))
        upstream = stack.enter_context(scripted_upstream(openai_text_routes("Hello world!", hold=gate)))
        text = config(upstream, pg.url, redis.url)
        urls = []
        for name in ("a", "b"):
            (tmp / name).mkdir()
            urls.append(stack.enter_context(running_gateway(text, tmp / name)))
        yield {"a": urls[0], "b": urls[1], "gate": gate, "pg": pg, "redis": redis, "upstream": upstream}


def test_a_token_budget_holds_across_two_replicas_under_concurrency(fleet: dict[str, Any]) -> None:
    a, b, gate = fleet["a"], fleet["b"], fleet["gate"]
    key = create_key(a, name="budgeted", tpm=1_000_000, max_tokens_per_day=BUDGET)
    wait_until(lambda: knows(b, key["key"]), "replica b knows the key made on replica a")
    doors = ["openai", "anthropic", "tgi"]
    calls = [(url, doors[i % 3]) for i, url in enumerate([a, b] * 10)]  # twenty requests, ten on each replica
    results: list[httpx.Response | None] = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = send(calls[i][0], calls[i][1], key["key"])

    gate.close()  # the admitted ones wait at the upstream, holding their reservations
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: sum(r is not None for r in results) == 15 and gate.waiting == 5,
                   "fifteen refused while five wait at the upstream")
    finally:
        gate.open()
        for thread in threads:
            thread.join()
    served = [(door, r) for (_, door), r in zip(calls, results) if r is not None and r.status_code == 200]
    refused = [(door, r) for (_, door), r in zip(calls, results) if r is not None and r.status_code != 200]
    assert len(served) == 5 and len(refused) == 15
    assert all(is_protocol_429(door, r) for door, r in refused), [(d, r.status_code, r.text) for d, r in refused]
    assert {door for door, _ in refused} == set(doors)
    rows = wait_until(lambda: (d := httpx.get(f"{b}/admin/usage", params={"key": "budgeted", "group_by": "key"},
                                              headers=ADMIN_HEADERS, timeout=CLIENT_TIMEOUT).json()["data"])
                      and d[0]["requests"] == 20 and d, "both replicas' usage rows in Postgres")
    assert rows[0]["errors"] == 15 and rows[0]["total_tokens"] <= BUDGET
    # the five settled to what they used (6 tokens each), so the budget has room again: reconciled, not leaked
    assert send(a, "openai", key["key"]).status_code == 200


def test_request_rates_are_shared_and_a_revoked_key_stops_on_the_other_replica(fleet: dict[str, Any]) -> None:
    a, b = fleet["a"], fleet["b"]
    key = create_key(a, name="two-a-minute", rpm=2)
    wait_until(lambda: knows(b, key["key"]), "replica b knows the key")
    assert [send(url, "openai", key["key"]).status_code for url in (a, b, a, b)] == [200, 200, 429, 429]
    revoked = httpx.delete(f"{b}/admin/keys/{key['id']}", headers=ADMIN_HEADERS, timeout=CLIENT_TIMEOUT)
    assert revoked.status_code == 200
    wait_until(lambda: send(a, "openai", key["key"]).status_code == 401, "replica a refuses the revoked key")


def test_limits_fail_open_while_redis_is_down(fleet: dict[str, Any]) -> None:
    a, redis = fleet["a"], fleet["redis"]
    key = create_key(a, name="while-redis-is-down", rpm=1000)
    redis.stop()
    try:
        assert send(a, "openai", key["key"]).status_code == 200  # fail_open (the default): served, unlimited
        metrics = httpx.get(f"{a}/metrics", timeout=CLIENT_TIMEOUT).text
        assert 'llmgw_limiter_up{shared="true"} 0.0' in metrics
        assert "llmgw_limiter_unenforced_total 1.0" in metrics
    finally:
        redis.start()
    wait_until(lambda: send(a, "openai", key["key"]).status_code == 200 and 'llmgw_limiter_up{shared="true"} 1.0'
               in httpx.get(f"{a}/metrics", timeout=CLIENT_TIMEOUT).text, "limits enforced again")


def test_a_postgres_outage_loses_no_usage_row_and_known_keys_keep_working(fleet: dict[str, Any]) -> None:
    a, pg = fleet["a"], fleet["pg"]
    key = create_key(a, name="through-the-outage")
    assert all(send(a, door, key["key"]).status_code == 200 for door in ("openai", "anthropic", "tgi"))
    wait_until(lambda: usage_count(pg.url, "through-the-outage") == 3, "the first rows written")
    pg.stop()
    try:
        assert [send(a, "openai", key["key"]).status_code for _ in range(8)] == [200] * 8
        health = wait_until(lambda: (r := httpx.get(f"{a}/health", timeout=CLIENT_TIMEOUT)).content and r,
                            "/health says the store is down")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert health.json()["state_store"]["usage"]["buffered"] >= 8
        # /health turns degraded at the first failed usage write; the store-up gauge at the first failed key read
        def store_down() -> str | None:
            text = httpx.get(f"{a}/metrics", timeout=CLIENT_TIMEOUT).text
            return text if "llmgw_state_store_up 0.0" in text else None

        metrics = wait_until(store_down, "llmgw_state_store_up 0 (a key read failed)")
        assert "llmgw_usage_rows_dropped_total 0.0" in metrics
    finally:
        pg.start()
    wait_until(lambda: usage_count(pg.url, "through-the-outage") == 11, "every buffered row written after the outage")
    wait_until(lambda: httpx.get(f"{a}/health", timeout=CLIENT_TIMEOUT).content == b"", "/health is plain 200 again")


def test_a_stored_response_continues_and_is_deleted_on_the_other_replica(fleet: dict[str, Any]) -> None:
    a, b, upstream = fleet["a"], fleet["b"], fleet["upstream"]
    key = create_key(a, name="responder")
    other = create_key(a, name="someone-else")
    wait_until(lambda: knows(b, key["key"]) and knows(b, other["key"]), "replica b knows both keys")
    first = httpx.post(f"{a}/v1/responses", json={"model": "m", "input": "My name is Ada.", "store": True},
                       headers=bearer(key["key"]), timeout=CLIENT_TIMEOUT).json()
    stored = httpx.get(f"{b}/v1/responses/{first['id']}", headers=bearer(key["key"]), timeout=CLIENT_TIMEOUT)
    assert stored.status_code == 200 and stored.json()["id"] == first["id"]
    assert httpx.get(f"{b}/v1/responses/{first['id']}", headers=bearer(other["key"]),
                     timeout=CLIENT_TIMEOUT).status_code == 404  # another key's response does not exist for it
    follow = httpx.post(f"{b}/v1/responses", json={"model": "m", "input": "What is my name?",
                                                   "previous_response_id": first["id"]},
                        headers=bearer(key["key"]), timeout=CLIENT_TIMEOUT)
    assert follow.status_code == 200, follow.text
    sent = upstream.sent("/v1/chat/completions")[-1]["messages"]
    assert [(m["role"], m["content"]) for m in sent] == [("user", "My name is Ada."), ("assistant", "Hello world!"),
                                                          ("user", "What is my name?")]
    deleted = httpx.delete(f"{b}/v1/responses/{first['id']}", headers=bearer(key["key"]), timeout=CLIENT_TIMEOUT)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert httpx.get(f"{a}/v1/responses/{first['id']}", headers=bearer(key["key"]),
                     timeout=CLIENT_TIMEOUT).status_code == 404


def test_per_key_metrics_are_named_bounded_and_never_secret(fleet: dict[str, Any]) -> None:
    a = fleet["a"]
    secrets = [create_key(a, name=f"metered-{i}")["key"] for i in range(5)]
    for secret in secrets:
        assert send(a, "openai", secret).status_code == 200
    text = httpx.get(f"{a}/metrics", timeout=CLIENT_TIMEOUT).text
    labels = {line.split('key="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("llmgw_key_requests_total{")}
    assert len(labels) == 4 and "other" in labels  # three names (max_key_series), the rest under "other"
    assert 'llmgw_key_tokens_total{key="other",kind="completion",model="m"}' in text
    assert not any(secret in text for secret in secrets)
