"""The guarded gateway of the guard tests: a real gateway process with API keys, limits, retries and
timeouts in front of scripted upstreams (one module-scoped fixture per test module that uses it), and the
HTTP helpers those tests share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.recordings import openai_text_routes
from tests.server import CLIENT_TIMEOUT, WAIT, running_gateway
from tests.upstream import CUT, Hold, Reply, ScriptedUpstream, scripted_upstream, sse

KEY_A = "a-secret-0123456789"  # from the environment
KEY_OPS = "ops-secret-0123456789"  # in the file
KEY_T = "tokens-secret-0123456789"  # 12 tokens per minute
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


OPS = auth(KEY_OPS)


def flaky_routes(failures: int) -> tuple[dict, list[int]]:
    """503 for the first `failures` requests, then a normal answer; counts requests."""
    good = openai_text_routes("Recovered fine")
    calls = [0]

    def answer(path: str):  # noqa: ANN202
        def reply(body: dict[str, Any]) -> Reply:
            calls[0] += 1
            if calls[0] <= failures:
                return Reply([b'{"error": {"message": "warming up"}}'], 503, "application/json")
            route = good[("POST", path)]
            return route(body) if callable(route) else route
        return reply

    routes = {**good, ("POST", "/v1/chat/completions"): answer("/v1/chat/completions")}
    return routes, calls


def hang_after_first() -> dict:
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "Start"}, "finish_reason": None}]}
    return {("GET", "/v1/models"): Reply([b"{}"], 200, "application/json"),
            ("POST", "/v1/chat/completions"): Reply([sse(chunk), 30.0, sse(chunk)])}


def garbage() -> dict:
    return {("GET", "/v1/models"): Reply([b"{}"], 200, "application/json"),
            ("POST", "/v1/chat/completions"): Reply([b"data: {not json at all\n\n", b"\x00\xff junk", CUT])}


def firehose() -> dict:
    """A stream far larger than any socket buffer: 3,000 events of 8 KB, as fast as it can be read."""
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "x" * 8192}, "finish_reason": None}]}
    return {("GET", "/v1/models"): Reply([b"{}"], 200, "application/json"),
            ("POST", "/v1/chat/completions"): Reply([sse(chunk)] * 3000)}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any], Path]]:
    flaky2, calls2 = flaky_routes(2)
    flaky5, calls5 = flaky_routes(5)
    gate = Hold()  # the "gated" upstream answers only once a test opens it
    with ExitStack() as stack:
        up: dict[str, ScriptedUpstream] = {name: stack.enter_context(scripted_upstream(routes)) for name, routes in {
            "good": openai_text_routes("Hello world!"), "slow": openai_text_routes("Slow answer", first_delay=1.5),
            "gated": openai_text_routes("Held answer", hold=gate),
            "flaky2": flaky2, "flaky5": flaky5, "hang": hang_after_first(), "garbage": garbage(),
            "firehose": firehose()}.items()}
        backends = "".join(f'[backends.{n}]\ntype = "openai"\nbase_url = "{u.url}"\nmodel = "m"\n'
                           f"first_token_timeout = {WAIT}\nidle_timeout = 60\n\n"
                           for n, u in up.items())
        config = f"""
[server]
max_body_bytes = 20000
body_timeout = 1.0
send_timeout = 1.0
health_check_interval = 60
eject_after_failures = 1000

[auth]
protect_metrics = true
[[auth.keys]]
name = "team-a"
key_env = "LLMGW_TEST_KEY_A"
models = ["open"]
requests_per_minute = 3
[[auth.keys]]
name = "team-t"
key = "{KEY_T}"
tokens_per_minute = 12
[[auth.keys]]
name = "ops"
key = "{KEY_OPS}"

{backends}
[models.open]
backend = "good"
[models.other]
backend = "good"
[models.one-at-a-time]
backend = "gated"
max_concurrent_requests = 1
max_queued_requests = 1
max_queue_wait = 2.0
[models.patient]
backend = "slow"
max_concurrent_requests = 1
max_queued_requests = 4
max_queue_wait = 10
[models.retried]
backend = "flaky2"
retries = 2
retry_backoff = 0.05
[models.retried-not-enough]
backend = "flaky5"
retries = 1
retry_backoff = 0.05
[models.deadline]
backend = "hang"
request_timeout = 1.0
[models.firehose]
backend = "firehose"
[models.garbage]
backend = "garbage"
[models.slow-with-deadline]
backend = "slow"
request_timeout = 0.5
"""
        tmp = tmp_path_factory.mktemp("guarded")
        url = stack.enter_context(running_gateway(config, tmp, env={"LLMGW_TEST_KEY_A": KEY_A}))
        yield url, {"calls2": calls2, "calls5": calls5, "gate": gate, **up}, tmp / "server.log"


def chat(url: str, model: str, key: str = KEY_OPS, stream: bool = False, **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=auth(key),
                      json={"model": model, "stream": stream, **CHAT, **extra}, timeout=CLIENT_TIMEOUT)


def get(url: str, **kw: Any) -> httpx.Response:
    return httpx.get(url, timeout=CLIENT_TIMEOUT, **kw)


def post(url: str, **kw: Any) -> httpx.Response:
    return httpx.post(url, timeout=CLIENT_TIMEOUT, **kw)


def openai_error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, r.text
    return body["error"]


def tgi_error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error", "error_type"}, r.text
    return body
