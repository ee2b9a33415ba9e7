"""Event streams while the upstream is silent: keep-alive comments every `server.sse_keepalive` seconds
(as TGI's axum sends), the events intact around them, and a client that leaves mid-silence closes the
upstream request. Through a real gateway process in front of a scripted upstream that waits for the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import CLIENT_TIMEOUT, running_gateway, wait_until
from tests.upstream import Hold, Reply, ScriptedUpstream, scripted_upstream, sse

CHUNK = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": None}]}
LAST = {**CHUNK, "choices": [{"index": 0, "delta": {"content": " world"}, "finish_reason": "stop"}]}
TEXT = {"id": "x", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": "Hello", "finish_reason": None}]}
TEXT_LAST = {**TEXT, "choices": [{"index": 0, "text": " world", "finish_reason": "stop"}]}


@pytest.fixture()
def silent_upstream(tmp_path: Path) -> Iterator[tuple[str, ScriptedUpstream, Hold]]:
    hold = Hold()
    routes = {("GET", "/v1/models"): Reply([b"{}"], 200, "application/json"),
              ("POST", "/v1/chat/completions"): Reply([sse(CHUNK), hold, sse(LAST), sse(b"[DONE]")]),
              ("POST", "/v1/completions"): Reply([sse(TEXT), hold, sse(TEXT_LAST), sse(b"[DONE]")])}
    with scripted_upstream(routes) as upstream:
        config = f"""
[server]
sse_keepalive = 0.1
health_check_interval = 60

[backends.up]
type = "openai"
base_url = "{upstream.url}"
model = "m"
first_token_timeout = 120
idle_timeout = 120

[models.m]
backend = "up"
"""
        with running_gateway(config, tmp_path) as url:
            yield url, upstream, hold


def read_until(lines: Iterator[str], seen: list[str], done: Any) -> None:
    for line in lines:
        seen.append(line)
        if done(seen):
            return
    raise AssertionError(f"the stream ended first: {seen}")


@pytest.mark.parametrize("door", ["openai", "tgi"])
def test_a_silent_upstream_gets_keepalive_comments_and_the_events_arrive_whole(
        silent_upstream: tuple[str, ScriptedUpstream, Hold], door: str) -> None:
    url, _, hold = silent_upstream
    path, body = (("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                            "stream": True}) if door == "openai" else
                  ("/generate_stream", {"inputs": "Hi", "parameters": {"max_new_tokens": 8}}))
    seen: list[str] = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=CLIENT_TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        # the first token, then comments while the upstream says nothing (three: not one lucky timer)
        read_until(lines, seen, lambda s: sum(line == ":" for line in s) >= 3)
        assert any(line.startswith("data: ") and "Hello" in line for line in seen[:seen.index(":")])
        hold.open()
        seen.extend(lines)
    data = [line for line in seen if line.startswith("data: ")]
    text = "".join(line for line in data if "world" in line)
    assert "world" in text and all(line in ("", ":") or line.startswith("data: ") for line in seen)
    if door == "openai":
        assert data[-1] == "data: [DONE]"


def test_a_client_leaving_a_silent_stream_closes_the_upstream_request(
        silent_upstream: tuple[str, ScriptedUpstream, Hold]) -> None:
    url, upstream, hold = silent_upstream
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    seen: list[str] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT) as r:
        read_until(r.iter_lines(), seen, lambda s: ":" in s)  # streaming, and the upstream silent
    # the client has gone: the gateway ends the request and closes its upstream one, so the upstream's next
    # write fails
    wait_until(lambda: in_flight(url) == 0, "the request ended in the gateway")
    hold.open()
    wait_until(lambda: upstream.broken_writes == 1, "the upstream request closed when the client left")
    assert not upstream.requests[-1].answered


def in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "llmgw_requests_in_flight" and s.labels.get("route") == "/v1/chat/completions")
