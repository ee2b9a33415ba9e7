"""State store outages a fleet lives through (real Postgres, real gateway processes, a scripted upstream):
a usage buffer that fills drops its oldest rows and counts them, and a key revoked while one replica could not
reach the database stops working there once it can again."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.recordings import openai_text_routes
from tests.server import CLIENT_TIMEOUT, running_gateway, wait_until
from tests.services import PostgresServer, TcpProxy, have_postgres, postgres_server
from tests.upstream import ScriptedUpstream, scripted_upstream

pytestmark = pytest.mark.skipif(not have_postgres(), reason="needs Debian's postgresql (.ci/run installs it)")
ADMIN = "admin-secret-0123456789"
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}
BUFFER_ROWS = 4
REFRESH = 0.5  # key_refresh_interval


def config(upstream: ScriptedUpstream, database: str, buffer_rows: int = 100_000) -> str:
    return (f'[backends.up]\ntype = "openai"\nbase_url = "{upstream.url}"\nmodel = "m"\n[models.m]\nbackend = "up"\n'
            f'[server]\nadmin_key = "{ADMIN}"\nhealth_check_interval = 60\n'
            f'[state]\ndatabase = "{database}"\nkey_refresh_interval = {REFRESH}\nusage_flush_interval = 0.2\n'
            f'usage_buffer_rows = {buffer_rows}\n')


def create_key(url: str, name: str) -> dict[str, Any]:
    r = httpx.post(f"{url}/admin/keys", json={"name": name}, headers=ADMIN_HEADERS, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 201, r.text
    return r.json()


def chat(url: str, secret: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {secret}"},
                      json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
                      timeout=CLIENT_TIMEOUT)


def request_ids(database: str, key: str) -> list[str]:
    async def fetch() -> list[str]:
        conn = await asyncpg.connect(database)
        try:
            rows = await conn.fetch("SELECT request_id FROM usage WHERE key_name = $1", key)
            return [row["request_id"] for row in rows]
        finally:
            await conn.close()

    return asyncio.run(fetch())


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not on /metrics")


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("outage")
    with ExitStack() as stack:
        pg: PostgresServer = stack.enter_context(postgres_server(tmp))
        upstream = stack.enter_context(scripted_upstream(openai_text_routes("Hello world!")))
        yield {"tmp": tmp, "pg": pg, "upstream": upstream}


def test_a_full_usage_buffer_drops_the_oldest_rows_and_counts_them(services: dict[str, Any]) -> None:
    pg: PostgresServer = services["pg"]
    tmp: Path = services["tmp"] / "buffer"
    tmp.mkdir()
    with running_gateway(config(services["upstream"], pg.url, buffer_rows=BUFFER_ROWS), tmp) as url:
        key = create_key(url, "buffered")
        assert chat(url, key["key"]).status_code == 200
        wait_until(lambda: len(request_ids(pg.url, "buffered")) == 1, "the first row written")
        pg.stop()
        try:
            sent = [chat(url, key["key"]) for _ in range(BUFFER_ROWS + 3)]
            assert [r.status_code for r in sent] == [200] * len(sent)  # known keys keep working
            wait_until(lambda: metric(url, "llmgw_usage_rows_dropped_total") == 3, "the 3 oldest rows dropped")
            health = wait_until(lambda: (r := httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT)).content and r,
                                "/health saying the store is degraded (once a usage write or a key read failed)")
            assert health.status_code == 200 and health.json()["status"] == "degraded"
            status = health.json()["state_store"]["usage"]
            assert status["buffered"] == BUFFER_ROWS and status["dropped"] == 3
        finally:
            pg.start()
        newest = {r.headers["x-request-id"] for r in sent[3:]}
        wait_until(lambda: len(request_ids(pg.url, "buffered")) == 1 + BUFFER_ROWS, "the buffered rows written")
        written = set(request_ids(pg.url, "buffered"))
        assert newest <= written, "the newest rows were kept"
        assert not {r.headers["x-request-id"] for r in sent[:3]} & written, "the oldest rows were the ones dropped"
        assert metric(url, "llmgw_usage_rows_dropped_total") == 3


def test_a_key_revoked_while_a_replica_could_not_reach_the_store_stops_there_once_it_can(
        services: dict[str, Any]) -> None:
    pg: PostgresServer = services["pg"]
    tmp: Path = services["tmp"] / "partition"
    (tmp / "a").mkdir(parents=True)
    (tmp / "b").mkdir()
    proxy = TcpProxy(pg.port)  # replica a reaches Postgres through it; b directly
    try:
        with running_gateway(config(services["upstream"], pg.url.replace(str(pg.port), str(proxy.port))),
                             tmp / "a") as a, \
                running_gateway(config(services["upstream"], pg.url), tmp / "b") as b:
            key = create_key(b, "partitioned")
            wait_until(lambda: chat(a, key["key"]).status_code == 200, "replica a knows the key")
            proxy.cut()
            wait_until(lambda: metric(a, "llmgw_state_store_up") == 0, "replica a sees the store down")
            revoked = httpx.delete(f"{b}/admin/keys/{key['id']}", headers=ADMIN_HEADERS, timeout=CLIENT_TIMEOUT)
            assert revoked.status_code == 200, revoked.text
            assert chat(b, key["key"]).status_code == 401  # b saw the revocation
            assert chat(a, key["key"]).status_code == 200  # a cannot know: its last snapshot holds
            proxy.restore()
            wait_until(lambda: chat(a, key["key"]).status_code == 401, "the revoked key refused on replica a",
                       timeout=30 * REFRESH + 30)  # a refresh, and the reconnect's backoff
            assert metric(a, "llmgw_state_store_up") == 1
    finally:
        proxy.close()
