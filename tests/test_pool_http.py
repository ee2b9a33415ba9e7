"""HTTP replica pools over several real upstream servers: a real gateway process in front of
OpenAI-compatible upstreams (tests/upstream.py), or the pool itself where the test needs a double
(the DNS resolver) or to look inside (which replica objects a reload kept)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.base import GenerationRequest
from backends.pool.build import make_backend
from backends.pool.pool import PoolBackend
from gateway.config import parse_config
from gateway.state import Gateway
from tests.recordings import openai_text_routes
from tests.server import CLIENT_TIMEOUT, WAIT, free_port, running_gateway, wait_until
from tests.upstream import Hold, Reply, ScriptedUpstream, scripted_upstream


def pool_config(urls: list[str], balance: str, extra: str = "", server: str = "") -> str:
    endpoints = ", ".join(f'"{u}"' for u in urls)
    return (f'default_model = "m"\n\n[server]\nhealth_check_interval = 0.5\n{server}\n'
            f'[backends.pool]\ntype = "openai"\nmodel = "m"\nflavor = "vllm"\nendpoints = [{endpoints}]\n'
            f'balance = "{balance}"\nscrape_interval = 0\n{extra}\n'
            f'[models.m]\nbackend = "pool"\n')


def gateway(config: str, tmp_path: Path) -> contextlib.AbstractContextManager[str]:
    return running_gateway(config, tmp_path, timeout=180)  # remote backends only: no model to load


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=CLIENT_TIMEOUT, max_retries=0)


def complete(url: str, prompt: str = "Hi") -> str:
    return client(url).completions.create(model="m", prompt=prompt, max_tokens=4).choices[0].text


def samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text
    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def by_replica(url: str, name: str, **labels: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for key, value in samples(url, name).items():
        d = dict(key)
        if all(d.get(k) == v for k, v in labels.items()):
            found[d["replica"]] = found.get(d["replica"], 0.0) + value
    return found


def completions(upstream: ScriptedUpstream) -> list[dict[str, Any]]:
    return upstream.sent("/v1/completions")


def access_log(path: Path) -> list[dict[str, Any]]:
    # raw_decode: another logger's line may follow a JSON line without a newline in between
    lines = [json.JSONDecoder().raw_decode(line)[0] for line in path.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "request"]


@contextlib.contextmanager
def upstreams(n: int, routes: Callable[[int], dict] | None = None) -> Iterator[list[ScriptedUpstream]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(scripted_upstream(routes(i) if routes else openai_text_routes("Hello there")))
               for i in range(n)]


def test_a_pool_of_one_endpoint_serves_as_a_single_backend(tmp_path: Path) -> None:
    with upstreams(1) as (up,), gateway(pool_config([up.url], "prefix"), tmp_path) as url:
        response = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 4},
                              timeout=CLIENT_TIMEOUT)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "Hello there"
        assert response.headers["x-backend"] == "pool"  # clients and dashboards see the backend, not the replica
        assert by_replica(url, "llmgw_replica_requests_total") == {up.url: 1.0}


def test_round_robin_spreads_requests_evenly_and_says_why(tmp_path: Path) -> None:
    with upstreams(3) as ups, gateway(pool_config([u.url for u in ups], "round_robin"), tmp_path) as url:
        for i in range(30):
            assert complete(url, f"prompt {i}") == "Hello there"
        assert [len(completions(u)) for u in ups] == [10, 10, 10]
        assert by_replica(url, "llmgw_replica_requests_total") == {u.url: 10.0 for u in ups}
        assert by_replica(url, "llmgw_balancer_choices_total", reason="round_robin") == {u.url: 10.0 for u in ups}
        log = access_log(tmp_path / "server.log")
        served = Counter(line["replica"] for line in log if line.get("route") == "/v1/completions")
        assert served == Counter({u.url: 10 for u in ups})
        assert {line["balance"] for line in log if line.get("route") == "/v1/completions"} == {"round_robin"}


def test_least_load_sends_new_requests_away_from_a_slow_replica(tmp_path: Path) -> None:
    hold = Hold()  # the slow replica answers only when the test lets it

    def routes(i: int) -> dict:
        return openai_text_routes("Hello there", hold=hold if i == 0 else None)

    with upstreams(2, routes) as (slow, fast), \
            gateway(pool_config([slow.url, fast.url], "least_load"), tmp_path) as url:
        results: list[str] = []

        def send(i: int) -> None:
            results.append(complete(url, f"prompt {i}"))

        threads = []
        for i in range(10):  # one at a time: each either finishes (fast) or waits at the slow one
            thread = threading.Thread(target=send, args=(i,))
            thread.start()
            threads.append(thread)
            wait_until(lambda i=i: len(results) + hold.waiting == i + 1, f"request {i} answered or held")
        assert (len(completions(slow)), len(completions(fast))) == (1, 9)
        hold.open()
        for thread in threads:
            thread.join(WAIT)
        assert results == ["Hello there"] * 10
        for gauge in ("llmgw_replica_in_flight", "llmgw_replica_outstanding_tokens"):  # nothing left counted
            wait_until(lambda g=gauge: set(by_replica(url, g).values()) == {0.0}, f"{gauge} back to 0")


def test_least_load_reads_the_replicas_own_metrics(tmp_path: Path) -> None:
    """A replica busy with other clients' requests (its /metrics says so) is avoided."""
    busy_metrics = (b"# HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\n"
                    b'vllm:num_requests_waiting{model_name="m"} 30.0\n'
                    b"# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
                    b'vllm:num_requests_running{model_name="m"} 16.0\n')

    def routes(i: int) -> dict:
        scraped = Reply([busy_metrics if i == 0 else busy_metrics.replace(b"30.0", b"0.0").replace(b"16.0", b"1.0")],
                        200, "text/plain; version=0.0.4")
        return {**openai_text_routes("Hello there"), ("GET", "/metrics"): scraped}

    config = pool_config([], "least_load").replace("scrape_interval = 0", "scrape_interval = 0.2")
    with upstreams(2, routes) as (busy, idle):
        config = config.replace("endpoints = []", f'endpoints = ["{busy.url}", "{idle.url}"]')
        with gateway(config, tmp_path) as url:
            wait_until(lambda: by_replica(url, "llmgw_replica_reported_waiting").get(busy.url) == 30.0,
                       "the busy replica's figures scraped")
            for i in range(6):
                complete(url, f"prompt {i}")
            assert (len(completions(busy)), len(completions(idle))) == (0, 6)


def test_prefix_policy_keeps_each_shared_prefix_on_one_replica(tmp_path: Path) -> None:
    with upstreams(2) as ups, gateway(pool_config([u.url for u in ups], "prefix"), tmp_path) as url:
        for question in range(4):
            for group in range(4):
                complete(url, f"System prompt of group {group}. " * 20 + f"Question {question}?")
        for up in ups:
            groups = Counter(body["prompt"].split(".")[0] for body in completions(up))
            assert all(count == 4 for count in groups.values())  # a group's four prompts all went here
        assert sorted(len(completions(u)) for u in ups) == [8, 8]  # and the groups were spread
        reasons: Counter[str] = Counter()
        for labels, value in samples(url, "llmgw_balancer_choices_total").items():
            reasons[dict(labels)["reason"]] += int(value)
        assert reasons == Counter({"cold": 4, "prefix_hit": 12})


def test_a_failing_replica_is_ejected_then_returns(tmp_path: Path) -> None:
    state = {"failing": True, "check_fails": False}
    good_routes = openai_text_routes("Hello there")
    bad_routes = openai_text_routes("x", status=503)

    def routes(i: int) -> dict:
        if i == 1:
            return good_routes

        def completion(body: dict) -> Reply:
            reply = (bad_routes if state["failing"] else good_routes)[("POST", "/v1/completions")]
            return reply(body) if callable(reply) else reply

        def models(body: dict) -> Reply:
            return Reply([b'{"data":[]}'], 503 if state["check_fails"] else 200, "application/json")

        return {("POST", "/v1/completions"): completion, ("GET", "/v1/models"): models}

    extra = "eject_after_failures = 2\neject_cooldown = 1.0\n"
    with upstreams(2, routes) as (flaky, good), \
            gateway(pool_config([flaky.url, good.url], "round_robin", extra), tmp_path) as url:
        for i in range(8):  # every request is answered: the pool moves it off the failing replica
            assert complete(url, f"prompt {i}") == "Hello there"
        assert by_replica(url, "llmgw_replica_ejections_total").get(flaky.url, 0) >= 1
        assert by_replica(url, "llmgw_replica_errors_total", kind="unavailable").get(flaky.url, 0) >= 2
        state["failing"] = False

        def served_by_flaky() -> bool:
            before = len([r for r in flaky.requests if r.path == "/v1/completions" and r.answered])
            complete(url)
            complete(url)
            return len([r for r in flaky.requests if r.path == "/v1/completions" and r.answered]) > before

        wait_until(served_by_flaky, "the replica back in the pool after its cool-down")
        # an active health check that fails takes it out too, and /health stays 200 on the other
        state["check_fails"] = True
        wait_until(lambda: by_replica(url, "llmgw_replica_healthy").get(flaky.url) == 0.0, "replica unhealthy")
        assert httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT).status_code == 200
        sent = len(completions(flaky))
        for i in range(4):
            complete(url, f"while unhealthy {i}")
        assert len(completions(flaky)) == sent
        state["check_fails"] = False
        wait_until(lambda: by_replica(url, "llmgw_replica_healthy").get(flaky.url) == 1.0, "replica healthy again")


# the pool in process: a DNS double, and what a reload keeps


def upstream_at(host: str, port: int, routes: dict) -> contextlib.AbstractContextManager[ScriptedUpstream]:
    """A scripted upstream on a given loopback address (DNS records share a port, not an address)."""
    return scripted_upstream(routes, host, port)


async def eventually(condition: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT} s: {what}"
        await asyncio.sleep(0.05)


async def generate(pool: Any, prompt: str) -> str:
    request = GenerationRequest(request_id="r", model="m", prompt=prompt, max_new_tokens=4)
    return "".join([event.text async for event in pool.generate(request)])


async def test_dns_discovery_follows_the_records(tmp_path: Path) -> None:
    port = free_port()
    records = {"addresses": ["127.0.0.2"]}

    async def resolver(host: str) -> list[str]:
        assert host == "vllm-headless.test"
        if records["addresses"] is None:
            raise OSError("resolver down")
        return list(records["addresses"])

    config = parse_config(f'[backends.p]\ntype = "openai"\nmodel = "m"\nbase_url = "http://vllm-headless.test:{port}"\n'
                          f'discovery = "dns"\ndns_interval = 0.1\nbalance = "round_robin"\nscrape_interval = 0\n\n'
                          f'[models.m]\nbackend = "p"\n')
    with upstream_at("127.0.0.2", port, openai_text_routes("two")) as two, \
            upstream_at("127.0.0.3", port, openai_text_routes("three")) as three:
        pool = make_backend("p", "openai", config.backends["p"].settings, resolver=resolver)
        assert isinstance(pool, PoolBackend)
        await pool.start()
        try:
            assert [r.id for r in pool.replicas] == [f"http://127.0.0.2:{port}"]
            assert await generate(pool, "a") == "two"
            records["addresses"] = ["127.0.0.2", "127.0.0.3"]  # scaled up
            await eventually(lambda: len(pool.replicas) == 2 and all(r.available() for r in pool.replicas),
                             "the new record picked up, and its replica started")
            assert sorted([await generate(pool, f"b{i}") for i in range(4)]) == ["three", "three", "two", "two"]
            records["addresses"] = None  # a failed lookup changes nothing
            await asyncio.sleep(0.3)
            assert len(pool.replicas) == 2
            records["addresses"] = ["127.0.0.3"]  # scaled down
            await eventually(lambda: [r.id for r in pool.replicas] == [f"http://127.0.0.3:{port}"], "record gone")
            sent_to_two = len(completions(two))
            assert [await generate(pool, f"c{i}") for i in range(3)] == ["three"] * 3
            assert len(completions(two)) == sent_to_two and len(completions(three)) == 5
        finally:
            await pool.aclose()


RELOAD = """
[server]
health_check_interval = 1000

[backends.p]
type = "openai"
model = "m"
endpoints = [{endpoints}]
balance = "{balance}"
scrape_interval = 0

[models.m]
backend = "p"
"""


async def test_a_reload_that_changes_a_pool_keeps_its_unchanged_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.state

    monkeypatch.setattr(gateway.state, "RETIRE_GRACE", 0.1)
    with upstreams(3, lambda i: openai_text_routes(f"from {i}")) as ups:
        def text(urls: list[ScriptedUpstream], balance: str) -> str:
            return RELOAD.format(endpoints=", ".join(f'"{u.url}"' for u in urls), balance=balance)

        gw = Gateway(parse_config(text(ups[:2], "prefix")))
        for name, backend in gw.backends.items():
            assert await gw._start(name, backend)
        old: Any = gw.backends["p"]
        kept = {r.id: r for r in old.replicas}[ups[1].url]
        models_probes = [len([r for r in u.requests if r.path == "/v1/models"]) for u in ups]
        await gw.reload(text(ups[1:], "round_robin"))  # replica 0 out, 2 in, 1 unchanged; another policy
        new: Any = gw.backends["p"]
        assert new is not old and [r.id for r in new.replicas] == [ups[1].url, ups[2].url]
        assert new.replicas[0] is kept and kept.backend is old.replicas[1].backend  # the same client, not restarted
        probes = [len([r for r in u.requests if r.path == "/v1/models"]) - models_probes[i] for i, u in enumerate(ups)]
        assert probes[1] < probes[2]  # the kept one is health-checked with the new pool, not started again
        await eventually(lambda: id(old) not in gw.started, "the old pool retired")
        # the kept replica outlived the pool it came from; the dropped one is closed
        assert sorted([await generate(new, f"p{i}") for i in range(4)]) == ["from 1", "from 1", "from 2", "from 2"]
        assert {r.id for r in old.replicas} == set() and len(completions(ups[0])) == 0
        await gw.aclose()


async def test_a_pool_told_of_a_failing_check_takes_the_replica_out_before_its_own_check() -> None:
    """What the fronts of one gateway tell each other (gateway/serving/front_feed.py carries HealthNews between them):
    a check that failed in one pool, then passed again, changes its twin at once, with no check of its own."""
    state = {"check_fails": False}

    def routes(i: int) -> dict:
        found = openai_text_routes(f"from {i}")
        if i == 0:
            found[("GET", "/v1/models")] = lambda body: Reply([b'{"data":[]}'], 503 if state["check_fails"] else 200,
                                                             "application/json")
        return found

    with upstreams(2, routes) as ups:
        config = parse_config(pool_config([u.url for u in ups], "round_robin"))
        seen, told = (make_backend("pool", "openai", config.backends["pool"].settings) for _ in range(2))
        assert isinstance(seen, PoolBackend) and isinstance(told, PoolBackend)
        await asyncio.gather(seen.start(), told.start())
        seen.health_listeners.append(told.hear)
        try:
            probes = len([r for r in ups[0].requests if r.path == "/v1/models"])
            state["check_fails"] = True
            await seen.health()
            assert [r.state() for r in told.replicas] == ["unhealthy", "healthy"]
            assert {await generate(told, f"p{i}") for i in range(4)} == {"from 1"}
            state["check_fails"] = False
            await seen.health()
            assert [r.state() for r in told.replicas] == ["healthy", "healthy"]
            assert sorted([await generate(told, f"q{i}") for i in range(4)]) == ["from 0", "from 0", "from 1", "from 1"]
            assert len([r for r in ups[0].requests if r.path == "/v1/models"]) == probes + 2  # the one pool's checks
        finally:
            await asyncio.gather(seen.aclose(), told.aclose())


def test_a_client_leaving_a_pooled_stream_closes_the_upstream_request(tmp_path: Path) -> None:
    hold = Hold()
    with upstreams(2, lambda i: openai_text_routes("one two three four", hold=hold, hold_after=1)) as ups, \
            gateway(pool_config([u.url for u in ups], "least_load"), tmp_path) as url:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=CLIENT_TIMEOUT,
                          json={"model": "m", "prompt": "Hi", "max_tokens": 4, "stream": True}) as response:
            first = next(response.iter_lines())
            assert first.startswith("data: ") and "one" in first
            wait_until(lambda: hold.waiting == 1, "the upstream holding the rest")
        # the client is gone: the replica's request is closed and nothing stays counted on it
        hold.open()
        wait_until(lambda: sum(u.broken_writes for u in ups) == 1, "the upstream request closed")
        wait_until(lambda: set(by_replica(url, "llmgw_replica_in_flight").values()) == {0.0}, "in flight 0")


def test_fallback_and_splits_treat_a_pool_as_one_backend(tmp_path: Path) -> None:
    with upstreams(2) as ups:
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        endpoints = ", ".join(f'"{u.url}"' for u in ups)
        config = (f'default_model = "m"\n\n[backends.old]\ntype = "openai"\nmodel = "m"\nbase_url = "{dead}"\n\n'
                  f'[backends.pool]\ntype = "openai"\nmodel = "m"\nendpoints = [{endpoints}]\nbalance = "round_robin"\n'
                  f'scrape_interval = 0\n\n[models.m]\nroutes = [{{backend = "old", weight = 1}}, '
                  f'{{backend = "pool", weight = 1}}]\nfallback = ["pool"]\n')
        with running_gateway(config, tmp_path, timeout=180, wait_healthy=False) as url:
            wait_until(lambda: httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT).status_code == 200, "ready")
            for i in range(8):
                response = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": f"p{i}", "max_tokens": 4},
                                      timeout=CLIENT_TIMEOUT)
                assert response.status_code == 200 and response.headers["x-backend"] == "pool"
            assert [len(completions(u)) for u in ups] == [4, 4]
