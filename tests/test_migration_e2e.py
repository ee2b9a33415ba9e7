"""Migration routing through a real gateway process: fallback tiers, shadow traffic and its
report, and hot reload under load."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.recordings import openai_text_routes
from tests.server import CLIENT_TIMEOUT, PROCESSES, ROOT, WAIT, running_gateway, wait_until
from tests.upstream import CUT, Hold, Recorded, Reply, ScriptedUpstream, scripted_upstream, sse

ADMIN = {"authorization": "Bearer admin-secret"}
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
CANDIDATE_HOLD = Hold()  # the shadow candidate answers only once the test opens this


def backend(name: str, url: str, first_token_timeout: float = WAIT) -> str:
    return (f'[backends.{name}]\ntype = "openai"\nbase_url = "{url}"\nmodel = "m"\n'
            f"first_token_timeout = {first_token_timeout}\n\n")


@pytest.fixture(scope="module")
def migration(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, ScriptedUpstream]]]:
    half = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": "Half"}, "text": "Half", "finish_reason": None}]}
    cut_routes = {("GET", "/v1/models"): Reply([b"{}"], 200, "application/json"),
                  ("POST", "/v1/chat/completions"): Reply([sse(half), CUT]),
                  ("POST", "/v1/completions"): Reply([sse(half), CUT])}
    with ExitStack() as stack:
        up = {name: stack.enter_context(scripted_upstream(routes)) for name, routes in {
            "good": openai_text_routes("Hello world!"), "doomed": openai_text_routes("never"),
            "five03": openai_text_routes("x", status=503), "slow": openai_text_routes("late", first_delay=5.0),
            "cutter": cut_routes, "primary": openai_text_routes("Hello world!"),
            "candidate": openai_text_routes("Hello there!", hold=CANDIDATE_HOLD)}.items()}
        config = '[server]\nadmin_key = "admin-secret"\nhealth_check_interval = 60\n\n'
        # only the hanging backend has a short first-token timeout: 1 s against its 5 s hang, it fires
        # whatever the machine's speed; the others (the candidate is held as long as a test needs) wait long
        config += "".join(backend(name, u.url, *([1.0] if name == "slow" else [])) for name, u in up.items())
        config += """
[models.fb-refuse]
backend = "doomed"
fallback = ["good"]
[models.fb-503]
backend = "five03"
fallback = ["good"]
[models.fb-hang]
backend = "slow"
fallback = ["good"]
[models.fb-after]
backend = "cutter"
fallback = ["good"]
[models.shadowed]
backend = "primary"
shadow = {backend = "candidate", sample = 1.0, max_concurrency = 8}
"""
        url = stack.enter_context(running_gateway(config, tmp_path_factory.mktemp("migration")))
        yield url, up


def test_refused_connection_before_the_first_token_falls_back(migration) -> None:
    url, up = migration
    up["doomed"].close()  # it was healthy at start; now nothing listens on its port
    for _ in range(3):
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "fb-refuse", **CHAT}, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world!"
        assert r.headers["x-backend"] == "good"
    assert not any(req.path == "/v1/chat/completions" for req in up["doomed"].requests)


@pytest.mark.parametrize(("model", "door"), [("fb-503", "openai"), ("fb-503", "tgi"), ("fb-hang", "openai"),
                                             ("fb-hang", "tgi")])
def test_503_or_a_hang_before_the_first_token_falls_back(migration, model: str, door: str) -> None:
    url, up = migration
    if door == "openai":
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "stream": True, **CHAT},
                       timeout=CLIENT_TIMEOUT)
        chunks = [json.loads(p[6:]) for p in r.text.split("\n\n") if p.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])
    else:
        r = httpx.post(f"{url}/models/{model}/generate", json={"inputs": "Hi"}, timeout=CLIENT_TIMEOUT)
        text = r.json()["generated_text"]
    assert r.status_code == 200 and text == "Hello world!" and r.headers["x-backend"] == "good"
    assert r.headers["x-config-version"] == httpx.get(f"{url}/info", timeout=CLIENT_TIMEOUT).json()["config_version"]
    first = "five03" if model == "fb-503" else "slow"
    assert f'llmgw_fallbacks_total{{from_backend="{first}",model="{model}",to_backend="good"}}' in \
        httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text


def test_a_failure_after_the_first_token_is_never_retried(migration) -> None:
    url, up = migration
    before = len(up["good"].requests)
    raw = httpx.post(f"{url}/v1/chat/completions", json={"model": "fb-after", "stream": True, **CHAT},
                     timeout=CLIENT_TIMEOUT).text
    payloads = [p[6:] for p in raw.split("\n\n") if p.startswith("data: ")]
    assert json.loads(payloads[0])["choices"][0]["delta"]["content"] == "Half"
    assert "error" in json.loads(payloads[-2]) and payloads[-1] == "[DONE]"
    tgi = httpx.post(f"{url}/models/fb-after/generate_stream", json={"inputs": "Hi"}, timeout=CLIENT_TIMEOUT).text
    assert '"text":"Half"' in tgi and '"error_type"' in tgi
    assert len(up["good"].requests) == before  # the second tier never saw these requests


def test_shadow_never_delays_the_primary_and_the_report_matches(migration, tmp_path: Path) -> None:
    """By order, not by the clock: the candidate is held until the test opens it, so every primary
    answer the client gets was complete before the candidate answered anything."""
    url, up = migration
    candidate = up["candidate"]

    def mirrored() -> list[Recorded]:
        return [r for r in candidate.requests if r.path == "/v1/chat/completions"]

    def pair() -> dict:
        [row] = httpx.get(f"{url}/admin/migrations", headers=ADMIN, timeout=CLIENT_TIMEOUT).json()["pairs"]
        return row

    def shadowed() -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", json={"model": "shadowed", **CHAT}, timeout=CLIENT_TIMEOUT)

    CANDIDATE_HOLD.close()
    latencies = []
    for _ in range(5):
        started = time.perf_counter()
        r = shadowed()
        latencies.append(time.perf_counter() - started)  # as the client saw it: to hold the candidate longer
        assert r.json()["choices"][0]["message"]["content"] == "Hello world!" and r.headers["x-backend"] == "primary"
        assert not any(m.answered for m in mirrored())  # the primary's answer came first
    assert httpx.get(f"{url}/admin/migrations", timeout=CLIENT_TIMEOUT).status_code == 401
    assert httpx.get(f"{url}/admin/migrations", headers={"authorization": "Bearer nope"},
                     timeout=CLIENT_TIMEOUT).status_code == 401
    wait_until(lambda: len(mirrored()) == 5 and CANDIDATE_HOLD.waiting == 5, "five mirrors waiting at the candidate")
    assert pair()["compared"] == 0  # nothing to compare before the candidate answers
    # the mirrors wait at least as long as the slowest primary answer took: each candidate TTFT (timed from
    # before its request went out to after the hold opened) then exceeds every primary TTFT, on any machine
    time.sleep(max(latencies))
    CANDIDATE_HOLD.open()
    row = wait_until(lambda: (row := pair())["compared"] == 5 and row, "the five pairs compared")
    assert (row["model"], row["primary"], row["candidate"], row["compared"]) == ("shadowed", "primary", "candidate", 5)
    assert row["exact_match_rate"] == 0.0 and row["dropped"] == 0
    assert row["mean_common_prefix_ratio"] == pytest.approx(len("Hello ") / len("Hello world!"))
    assert row["candidate_stats"]["ttft_p50_s"] > row["primary_stats"]["ttft_p50_s"]
    assert row["candidate_stats"]["mean_tokens"] == 2 and row["primary_stats"]["error_rate"] == 0.0
    assert row["candidate_stats"]["error_rate"] == 0.0
    printed = subprocess.run([sys.executable, "-m", "gateway", "migration-report", "--url", url, "--admin-key",
                              "admin-secret"], capture_output=True, text=True, cwd=ROOT, timeout=WAIT)
    assert printed.returncode == 0 and "primary -> candidate" in printed.stdout and "shadowed" in printed.stdout

    # a burst over the candidate's concurrency (8), the candidate held again: 8 mirrors run and wait, the
    # other 6 are dropped and counted, not queued, and every primary answer still arrives
    CANDIDATE_HOLD.close()
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(shadowed())) for _ in range(14)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 14 and all(a.status_code == 200 and a.headers["x-backend"] == "primary" for a in answers)
    assert sum(m.answered for m in mirrored()) == 5  # none of the burst's mirrors has been answered
    assert pair()["dropped"] == 6
    CANDIDATE_HOLD.open()
    row = wait_until(lambda: (row := pair())["compared"] == 5 + 8 and row, "the burst's eight pairs compared")
    assert row["dropped"] == 6 and row["compared"] + row["dropped"] == 5 + 14
    metrics = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text
    labels = 'candidate="candidate",model="shadowed"'
    assert f'llmgw_shadow_comparisons_total{{{labels},outcome="differ",primary="primary"}} {row["compared"]}.0' \
        in metrics
    assert f'llmgw_shadow_comparisons_total{{{labels},outcome="dropped",primary="primary"}} {row["dropped"]}.0' \
        in metrics


def test_reload_under_load_switches_backends_without_a_failed_request(tmp_path: Path) -> None:
    with scripted_upstream(openai_text_routes("alpha one two three", gap=0.03)) as a, \
            scripted_upstream(openai_text_routes("beta one two three", gap=0.03)) as b:
        def config(target: str) -> str:
            which = a if target == "a" else b
            return ('[server]\nadmin_key = "admin-secret"\n\n' + backend(target, which.url) +
                    f'[models.m]\nbackend = "{target}"\n')

        with running_gateway(config("a"), tmp_path) as url:
            path = tmp_path / "config.toml"
            failures: list[str] = []
            served: list[str] = []
            stop = threading.Event()

            def client(stream: bool) -> None:
                with httpx.Client(timeout=CLIENT_TIMEOUT) as c:
                    while not stop.is_set():
                        try:
                            r = c.post(f"{url}/v1/chat/completions", json={"model": "m", "stream": stream, **CHAT})
                            body = r.text
                            word = "alpha" if r.headers.get("x-backend") == "a" else "beta"
                            if r.status_code != 200 or word not in body or "error" in body:
                                failures.append(f"{r.status_code} {r.headers.get('x-backend')} {body[:200]}")
                            served.append(r.headers["x-backend"])
                        except httpx.HTTPError as exc:
                            failures.append(repr(exc))

            def under_load() -> None:  # by count, not by time: some answers served since the last step
                mark = len(served)
                wait_until(lambda: len(served) >= mark + 6 or failures, "six more answers served")

            threads = [threading.Thread(target=client, args=(i % 2 == 0,)) for i in range(4)]
            for t in threads:
                t.start()
            versions = []
            for target in ["b", "a", "BAD", "b", "a", "b"]:
                under_load()
                path.write_text(config(target) if target != "BAD" else "[models.m]\nbackend = 42\n")
                r = httpx.post(f"{url}/admin/reload", headers=ADMIN, timeout=CLIENT_TIMEOUT)
                if target == "BAD":
                    assert r.status_code == 400 and "nothing changed" in r.json()["error"]
                    info = httpx.get(f"{url}/info", timeout=CLIENT_TIMEOUT).json()
                    assert info["config_version"] == versions[-1]
                else:
                    assert r.status_code == 200, r.text
                    versions.append(r.json()["config_version"])
            under_load()
            stop.set()
            for t in threads:
                t.join()
            assert failures == []
            assert len(served) >= 7 * 6 and {"a", "b"} <= set(served)
            last = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", **CHAT}, timeout=CLIENT_TIMEOUT)
            assert last.headers["x-backend"] == "b" and last.headers["x-config-version"] == versions[-1]
            assert httpx.get(f"{url}/info", timeout=CLIENT_TIMEOUT).json()["config_version"] == versions[-1]


def test_sighup_and_the_file_watch_reload_the_config(tmp_path: Path) -> None:
    with scripted_upstream(openai_text_routes("alpha")) as a, scripted_upstream(openai_text_routes("beta")) as b:
        def config(target: ScriptedUpstream, watch: bool) -> str:
            return (f"[server]\nwatch_config = {str(watch).lower()}\n\n" + backend("x", target.url) +
                    '[models.m]\nbackend = "x"\n')

        def answer(url: str) -> str:
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", **CHAT}, timeout=CLIENT_TIMEOUT)
            return r.json()["choices"][0]["message"]["content"]

        def wait_for(url: str, text: str) -> None:
            wait_until(lambda: answer(url) == text, f"switched to {text!r}", interval=0.2)

        with running_gateway(config(a, watch=False), tmp_path) as url:
            assert answer(url) == "alpha"
            (tmp_path / "config.toml").write_text(config(b, watch=False))
            time.sleep(1.5)  # a watch would have seen it by now (it looks every second); a slow one only lets this pass
            assert answer(url) == "alpha"  # no watch: nothing happens until asked
            PROCESSES[url].send_signal(signal.SIGHUP)
            wait_for(url, "beta")
        watched = tmp_path / "watched"
        watched.mkdir()
        with running_gateway(config(a, watch=True), watched) as url:
            assert answer(url) == "alpha"
            (watched / "config.toml").write_text(config(b, watch=True))
            wait_for(url, "beta")
