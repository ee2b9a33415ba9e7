"""`[server] workers = 2`: one port served by two front processes over one engine worker (gateway/serving/fronts.py),
through real processes and the real model: the same greedy text as one process, one /metrics view of both
fronts, a front killed with SIGKILL under load that fails only its own requests and comes back, an engine
worker killed and restarted under every front, and a SIGTERM that drains and leaves no process."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.recordings import openai_text_routes
from tests.server import CLIENT_TIMEOUT, ENGINE_CONFIG, PROCESSES, running_gateway, wait_until
from tests.upstream import Reply, scripted_upstream

FRONTS_CONFIG = ENGINE_CONFIG.replace('type = "engine"\n', 'type = "engine"\nworkers = "process"\n') + """
[server]
workers = 2
admin_key = "fronts-admin-key"
health_check_interval = 0.2
eject_cooldown = 1.0

[state]

[[auth.keys]]
name = "tests"
key = "fronts-test-key"
"""
HEADERS = {"authorization": "Bearer fronts-test-key"}
STORY = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def fronts_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_gateway(FRONTS_CONFIG, tmp_path_factory.mktemp("fronts")) as url:
        wait_until(lambda: len(fronts(url)) == 2 and every_front_ready(url), "both fronts ready")
        yield url


def supervisor(url: str) -> psutil.Process:
    return psutil.Process(PROCESSES[url].pid)


def fronts(url: str) -> list[psutil.Process]:
    return [p for p in _living(supervisor(url).children()) if "gateway" in p.cmdline() and "serve" in p.cmdline()]


def engine_workers(url: str) -> list[psutil.Process]:
    return [p for p in _living(supervisor(url).children(recursive=True))
            if "backends.engine_worker" in " ".join(p.cmdline())]


def _living(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (one just killed is a zombie until the supervisor reaps it)."""
    alive = []
    for p in processes:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                p.cmdline()
                alive.append(p)
        except psutil.Error:
            pass
    return alive


def samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text
    return [(s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]


def total(url: str, name: str, **labels: str) -> float:
    return sum(v for found, v in samples(url, name) if all(found.get(k) == want for k, want in labels.items()))


def engine_idle(url: str) -> bool:
    used = samples(url, "llmgw_engine_kv_blocks_used")
    return bool(used) and all(v == 0 for _, v in used) and total(url, "llmgw_engine_running_seqs") == 0


def complete(url: str, prompt: str, client: httpx.Client | None = None) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    post = client.post if client is not None else httpx.post
    response = post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=CLIENT_TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def test_two_fronts_serve_one_port_from_one_engine_worker(fronts_gateway: str) -> None:
    url = fronts_gateway
    assert len(fronts(url)) == 2 and len(engine_workers(url)) == 1  # the model is loaded once
    # the engine worker is the supervisor's child: a front's death cannot take it along
    assert engine_workers(url)[0].ppid() == supervisor(url).pid
    # new connections go to either front; every answer is the same greedy text
    answers = {complete(url, "The capital of France is")["choices"][0]["text"] for _ in range(8)}
    assert len(answers) == 1 and answers.pop().strip()


def test_metrics_sum_the_requests_of_every_front_and_show_the_engine_once(fronts_gateway: str) -> None:
    url = fronts_gateway
    before = total(url, "llmgw_requests_total", route="/v1/completions")
    clients = [httpx.Client() for _ in range(6)]  # six connections: the kernel spreads them over the fronts
    try:
        barrier = threading.Barrier(len(clients))

        def send(client: httpx.Client) -> None:
            barrier.wait(CLIENT_TIMEOUT)
            for _ in range(2):
                complete(url, "Count to three:", client)

        threads = [threading.Thread(target=send, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CLIENT_TIMEOUT)
    finally:
        for c in clients:
            c.close()
    # whichever front answers the scrape, it counts all twelve, and the one engine once
    for _ in range(4):
        assert total(url, "llmgw_requests_total", route="/v1/completions") == before + 12
        assert len(samples(url, "llmgw_engine_kv_blocks_total")) == 1
    assert total(url, "llmgw_requests_in_flight", route="/v1/completions") == 0


def test_a_key_made_through_one_front_works_at_once_on_every_front(fronts_gateway: str) -> None:
    url = fronts_gateway
    made = httpx.post(f"{url}/admin/keys", json={"name": "made-just-now"}, timeout=CLIENT_TIMEOUT,
                      headers={"authorization": "Bearer fronts-admin-key"})
    assert made.status_code in (200, 201), made.text
    secret = made.json()["key"]
    # at once, on new connections (both fronts): none waits for the other front's next key refresh (2 s)
    statuses = [httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {secret}"},
                          timeout=CLIENT_TIMEOUT).status_code for _ in range(8)]
    assert statuses == [200] * 8
    wrong = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer not-a-key-at-all"}, timeout=CLIENT_TIMEOUT)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


def test_a_front_killed_under_load_fails_only_its_requests_and_is_started_again(fronts_gateway: str) -> None:
    url = fronts_gateway
    worker_pid = engine_workers(url)[0].pid
    results: dict[int, Any] = {}
    streaming = threading.Barrier(7)

    def stream(i: int) -> None:
        try:
            with httpx.Client() as client, client.stream("POST", f"{url}/v1/completions", json=STORY,
                                                         headers=HEADERS, timeout=CLIENT_TIMEOUT) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                streaming.wait(CLIENT_TIMEOUT)
                results[i] = [line for line in lines if line.startswith("data: ")]
        except httpx.TransportError as exc:
            results[i] = exc

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    streaming.wait(CLIENT_TIMEOUT)  # every stream has its first token
    # the front holding the most of the six connections dies without a word
    port = int(url.rsplit(":", 1)[1])
    held = {p.pid: sum(1 for c in p.net_connections("tcp") if c.laddr and c.laddr.port == port and c.raddr)
            for p in fronts(url)}
    victim = max(held, key=lambda pid: held[pid])
    assert held[victim] > 0
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(CLIENT_TIMEOUT)

    cut = [r for r in results.values() if isinstance(r, Exception)]
    finished = [r for r in results.values() if not isinstance(r, Exception)]
    assert len(results) == 6 and len(cut) == held[victim]  # the killed front's clients see their connection end
    for lines in finished:  # the other front's streams run to their end
        assert lines[-1] == "data: [DONE]"
    # the engine worker aborted the dead front's sequences: every block free again, the worker never restarted
    wait_until(lambda: engine_idle(url), "the dead front's sequences aborted in the engine worker")
    assert engine_workers(url)[0].pid == worker_pid
    wait_until(lambda: len(fronts(url)) == 2 and victim not in {p.pid for p in fronts(url)}
               and all(listening(p, url) for p in fronts(url)), "the front started again, listening")
    # it listens only once attached to the engine worker: no client of it meets a 503 meanwhile
    assert all(answers(url) for _ in range(8))


def test_an_engine_worker_killed_is_restarted_once_and_every_front_serves_again(fronts_gateway: str) -> None:
    url = fronts_gateway
    [worker] = engine_workers(url)
    results: list[httpx.Response] = []

    def whole() -> None:
        results.append(httpx.post(f"{url}/generate", json={"inputs": "Write a long poem", "parameters":
                                                           {"max_new_tokens": 1500}}, headers=HEADERS,
                                  timeout=CLIENT_TIMEOUT))

    thread = threading.Thread(target=whole)
    thread.start()
    wait_until(lambda: results or total(url, "llmgw_engine_running_seqs") == 1, "the request running")
    assert not results, f"the request ended before the worker was killed: {results[0].status_code} {results[0].text}"
    worker.kill()
    thread.join(CLIENT_TIMEOUT)
    assert results[0].status_code == 503 and results[0].json()["error_type"] == "unavailable"
    wait_until(lambda: len(engine_workers(url)) == 1 and engine_workers(url)[0].pid != worker.pid,
               "one new engine worker")
    # a front's health check may not have run yet: each front attached again once six answers in a row come
    wait_until(lambda: all(answers(url) for _ in range(6)), "every front attached to the new worker")
    texts = {complete(url, "The capital of France is")["choices"][0]["text"] for _ in range(6)}
    assert len(texts) == 1


def answers(url: str) -> bool:
    body = {"prompt": "Hi", "max_tokens": 2}
    return httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=CLIENT_TIMEOUT).status_code == 200


def test_sigterm_drains_every_front_and_leaves_no_process(tmp_path: Path) -> None:
    with running_gateway(FRONTS_CONFIG, tmp_path) as url:
        # both fronts attached to the engine worker: /health answers from one front, a request may reach the other
        wait_until(lambda: len(fronts(url)) == 2 and every_front_ready(url), "both fronts ready")
        family = [supervisor(url), *supervisor(url).children(recursive=True)]
        lines: list[str] = []
        first_token = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json={**STORY, "max_tokens": 40},
                              headers=HEADERS, timeout=CLIENT_TIMEOUT) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        first_token.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert first_token.wait(CLIENT_TIMEOUT)
        PROCESSES[url].send_signal(signal.SIGTERM)
        thread.join(CLIENT_TIMEOUT)
        assert PROCESSES[url].wait(CLIENT_TIMEOUT) == 0
        # the stream in flight ended whole: all 40 tokens (a sampled token that ends mid-character shares its chunk
        # with the next, so chunks can number fewer than tokens)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive


POOL_CONFIG = FRONTS_CONFIG.replace('workers = "process"\n', 'workers = "process"\nreplicas = 2\nbalance = "prefix"\n')
SHARED_PREFIX = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)


def listening(front: psutil.Process, url: str) -> bool:
    port = int(url.rsplit(":", 1)[1])
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in front.net_connections("tcp"))


def every_front_ready(url: str) -> bool:
    """Both fronts answered /health with 200 over fresh connections: each has its backends started (a front
    listening may still be attaching to its engine workers, and answers 503 meanwhile)."""
    ready: set[int] = set()
    for _ in range(16):
        with httpx.Client(timeout=CLIENT_TIMEOUT) as client:  # a new connection: either front takes it
            response = client.get(f"{url}/health")
            if response.status_code == 200:
                ready.add(serving_front(url, response))
        if len(ready) == 2:
            return True
    return False


def serving_front(url: str, response: httpx.Response) -> int:
    """The pid of the front holding this response's connection."""
    client_port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
    port = int(url.rsplit(":", 1)[1])
    for p in fronts(url):
        for c in p.net_connections("tcp"):
            if c.laddr and c.laddr.port == port and c.raddr and c.raddr.port == client_port:
                return p.pid
    raise AssertionError("no front holds the connection")


def test_prefix_routing_keeps_a_shared_prefix_on_one_replica_whichever_front_takes_it(tmp_path: Path) -> None:
    with running_gateway(POOL_CONFIG, tmp_path) as url:
        wait_until(lambda: len(fronts(url)) == 2 and len(engine_workers(url)) == 2, "two fronts, two replicas")
        # both started (its app, prefix feed included, up): a choice published before the other front subscribed
        # would be lost to it, as to a front that restarts (a cache miss)
        wait_until(lambda: every_front_ready(url), "both fronts ready")
        served_by: list[int] = []
        # one request at a time, each on a new connection, until both fronts have taken some
        while len(served_by) < 8 or len(set(served_by)) < 2:
            assert len(served_by) < 40, "the kernel never handed a connection to the second front"
            body = {"prompt": f"{SHARED_PREFIX} Question {len(served_by)}:", "max_tokens": 2, "stream": True}
            with httpx.Client() as client, client.stream("POST", f"{url}/v1/completions", json=body,
                                                         headers=HEADERS, timeout=CLIENT_TIMEOUT) as r:
                assert r.status_code == 200, r.read().decode()
                served_by.append(serving_front(url, r))
                assert [line for line in r.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
        choices = samples(url, "llmgw_balancer_choices_total")
        by_reason = {(labels["replica"], labels["reason"]): v for labels, v in choices if v}
        # the first went to a replica cold; every later one, on either front, found the prefix there
        [(first_replica, reason)] = [key for key in by_reason if key[1] != "prefix_hit"]
        assert reason == "cold" and by_reason[(first_replica, "cold")] == 1
        assert by_reason == {(first_replica, "cold"): 1, (first_replica, "prefix_hit"): len(served_by) - 1}


def test_a_replica_one_front_ejects_is_ejected_on_every_front(tmp_path: Path) -> None:
    """Replica health is shared: the front whose requests failed ejects the replica, and the other front
    sends it nothing more, without failures of its own (active checks are out of the way: one a minute)."""
    flaky_routes = openai_text_routes("x", status=503)
    flaky_routes[("GET", "/v1/models")] = Reply([b'{"data":[]}'], 200, "application/json")  # it passes checks
    with scripted_upstream(flaky_routes) as flaky, scripted_upstream(openai_text_routes("Hello there")) as good:
        config = (f'default_model = "m"\n[server]\nworkers = 2\nadmin_key = "fronts-admin-key"\n'
                  f'health_check_interval = 60\n\n[state]\n\n[[auth.keys]]\nname = "tests"\nkey = "fronts-test-key"\n\n'
                  f'[backends.pool]\ntype = "openai"\nmodel = "m"\nflavor = "vllm"\n'
                  f'endpoints = ["{flaky.url}", "{good.url}"]\nbalance = "round_robin"\nscrape_interval = 0\n'
                  f'eject_after_failures = 2\neject_cooldown = 600\n\n[models.m]\nbackend = "pool"\n')
        with running_gateway(config, tmp_path, timeout=180) as url:
            wait_until(lambda: len(fronts(url)) == 2 and every_front_ready(url), "both fronts ready")

            def ejections() -> float:
                return total(url, "llmgw_replica_ejections_total", replica=flaky.url)

            def sent_to_flaky() -> int:
                return sum(1 for r in flaky.requests if r.path == "/v1/completions")

            def answer(path: str, admin: bool = False) -> tuple[int, httpx.Response]:
                key = "fronts-admin-key" if admin else "fronts-test-key"
                with httpx.Client(timeout=CLIENT_TIMEOUT) as client:  # a new connection: either front takes it
                    response = client.request("GET" if admin else "POST", f"{url}{path}",
                                              headers={"authorization": f"Bearer {key}"},
                                              json=None if admin else {"model": "m", "prompt": "Hi", "max_tokens": 4})
                    assert response.status_code == 200, response.text
                    return serving_front(url, response), response

            def pool_state_on_each_front() -> dict[int, str]:
                seen: dict[int, str] = {}
                for _ in range(40):
                    pid, response = answer("/admin/backends", admin=True)
                    seen[pid] = response.json()["backends"]["pool"]
                    if len(seen) == 2:
                        return seen
                raise AssertionError("the kernel never handed a connection to the second front")

            # each front has both replicas up (a front listens before its pools have started them)
            wait_until(lambda: all("2/2 replicas healthy" in state for state in pool_state_on_each_front().values()),
                       "both replicas serving on both fronts")
            while ejections() == 0:  # every request is answered: the pool moves it off the failing replica
                assert answer("/v1/completions")[1].json()["choices"][0]["text"] == "Hello there"
                assert sent_to_flaky() < 40, "the failing replica was never ejected"
            sent = sent_to_flaky()
            # both fronts now say so: the one that ejected it, and the other, told
            seen = pool_state_on_each_front()
            assert all(f"{flaky.url} ejected" in state for state in seen.values()), seen
            served_by: list[int] = []
            while len(served_by) < 12 or len(set(served_by)) < 2:
                assert len(served_by) < 40, "the kernel never handed a connection to the second front"
                pid, response = answer("/v1/completions")
                served_by.append(pid)
                assert response.json()["choices"][0]["text"] == "Hello there"
            assert sent_to_flaky() == sent  # neither front sent it anything more
            assert ejections() == 1  # ejected once, by one front: the other never failed its way there
