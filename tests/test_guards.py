"""API keys, admission control, retries, timeouts and client limits, through a real gateway process
in front of scripted upstreams."""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient

from tests.recordings import openai_text_routes
from tests.server import CLIENT_TIMEOUT, WAIT, running_gateway, wait_until
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


# API keys

def test_missing_or_wrong_key_gets_401_in_each_protocols_shape(guarded: tuple) -> None:
    url, _, _ = guarded
    for headers in ({}, auth("wrong-key-000000"), {"authorization": KEY_OPS}):
        r = post(f"{url}/v1/chat/completions", headers=headers, json={"model": "open", **CHAT})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert openai_error(r)["type"] == "authentication_error"
        r = post(f"{url}/generate", headers=headers, json={"inputs": "Hi"})
        assert r.status_code == 401 and tgi_error(r)["error_type"] == "unauthorized"
    # checked before the body is even parsed: a bad body without a key is still a 401
    r = post(f"{url}/v1/completions", content=b"{broken", headers={"content-type": "application/json"})
    assert r.status_code == 401


def test_real_clients_pass_their_key(guarded: tuple) -> None:
    url, _, _ = guarded
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_OPS, max_retries=0, timeout=CLIENT_TIMEOUT)
    assert client.chat.completions.create(model="other", **CHAT).choices[0].message.content == "Hello world!"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope-nope-nope", max_retries=0,
                      timeout=CLIENT_TIMEOUT).chat.completions.create(model="other", **CHAT)
    tgi = InferenceClient(base_url=url, token=KEY_OPS, timeout=CLIENT_TIMEOUT)
    assert tgi.text_generation("Hi", max_new_tokens=5) == "Hi" + "Hello world!"  # "/" returns the full text, as TGI


def test_a_key_may_only_use_its_models(guarded: tuple) -> None:
    url, _, _ = guarded
    r = chat(url, "other", KEY_A)
    assert r.status_code == 403
    error = openai_error(r)
    assert error["type"] == "permission_error" and error["code"] == "model_not_allowed" and error["param"] == "model"
    r = post(f"{url}/models/other/generate", headers=auth(KEY_A), json={"inputs": "Hi"})
    assert r.status_code == 403 and tgi_error(r)["error_type"] == "forbidden"


def test_request_rate_limit_answers_429_with_retry_after(guarded: tuple) -> None:
    url, _, _ = guarded
    assert [chat(url, "open", KEY_A).status_code for _ in range(3)] == [200, 200, 200]  # 3 per minute
    r = chat(url, "open", KEY_A)
    assert r.status_code == 429 and openai_error(r)["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    r = post(f"{url}/models/open/generate", headers=auth(KEY_A), json={"inputs": "Hi"})
    assert r.status_code == 429 and tgi_error(r)["error_type"] == "rate_limited"
    assert chat(url, "open", KEY_OPS).status_code == 200  # other keys are not affected


def test_token_rate_limit_counts_prompt_and_generated_tokens(guarded: tuple) -> None:
    url, _, _ = guarded
    # each answer costs 4 prompt + 2 generated tokens (the scripted usage): 12 per minute is two
    statuses = [chat(url, "open", KEY_T).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    r = chat(url, "open", KEY_T)
    assert "12 tokens per minute" in openai_error(r)["message"] and int(r.headers["retry-after"]) >= 1


def test_health_is_open_metrics_are_protected_and_keys_never_leak(guarded: tuple) -> None:
    url, _, log = guarded
    assert get(f"{url}/health").status_code == 200
    assert get(f"{url}/live").status_code == 200
    assert get(f"{url}/metrics").status_code == 401
    metrics = get(f"{url}/metrics", headers=OPS)
    assert metrics.status_code == 200 and "llmgw_requests_total" in metrics.text
    bodies = [chat(url, "open", "wrong-" + KEY_A).text, chat(url, "other", KEY_A).text]
    text = log.read_text() + metrics.text + "".join(bodies)
    assert KEY_A not in text and KEY_OPS not in text


# admission control

def _parallel(calls: list[Any]) -> list[Any]:
    """Run the calls at once, each in its own thread; their results in order."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_over_the_model_limit_requests_wait_in_a_bounded_queue_then_get_429(guarded: tuple) -> None:
    """By order, not by the clock: the first request holds the only slot until the test opens its
    upstream; of two more sent together, one finds the queue (of one) full and is refused at once, the
    other waits its max_queue_wait in the queue, then is refused."""
    url, state, _ = guarded
    gate: Hold = state["gate"]

    def tgi() -> httpx.Response:
        return post(f"{url}/models/one-at-a-time/generate", headers=OPS, json={"inputs": "Hi"})

    for door, send in (("openai", lambda: chat(url, "one-at-a-time")), ("tgi", tgi)):
        gate.close()
        first: list[httpx.Response] = []
        holder = threading.Thread(target=lambda: first.append(send()))  # noqa: B023
        holder.start()
        wait_until(lambda: gate.waiting == 1, "the first request holds the slot, its upstream waiting")
        refused = _parallel([send, send])
        assert gate.waiting == 1  # the first still holds the slot: neither reached the upstream
        gate.open()
        holder.join()
        assert first[0].status_code == 200, first[0].text
        assert [r.status_code for r in refused] == [429, 429]
        if door == "openai":
            errors = [openai_error(r) for r in refused]
            assert {e["type"] for e in errors} == {"rate_limit_error"}
            assert sorted(e["code"] for e in errors) == ["overloaded", "queue_timeout"]  # full at once; waited 2 s
        else:
            assert [tgi_error(r) for r in refused] == [{"error": "Model is overloaded", "error_type": "overloaded"}] * 2


def test_queued_requests_are_served_in_turn(guarded: tuple) -> None:
    url, state, _ = guarded
    slow: ScriptedUpstream = state["slow"]
    before = len(slow.requests)
    results = _parallel([lambda: chat(url, "patient") for _ in range(3)])
    assert [r.status_code for r in results] == [200, 200, 200]
    # one at a time, by the upstream's own order of events: each request arrived after the previous answer
    served = sorted((r for r in slow.requests[before:] if r.path == "/v1/chat/completions"),
                    key=lambda r: r.received_at)
    assert len(served) == 3 and all(r.answered for r in served)
    assert all(later.received_at > earlier.sent_at[-1] for earlier, later in zip(served, served[1:]))


# retries and timeouts

def test_retries_before_the_first_token_with_backoff(guarded: tuple) -> None:
    url, state, _ = guarded
    r = chat(url, "retried")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Recovered fine"
    assert state["calls2"][0] == 3  # two 503s, then the answer
    r = chat(url, "retried-not-enough")
    assert r.status_code == 503 and state["calls5"][0] == 2  # bounded: one retry, then the error
    metrics = get(f"{url}/metrics", headers=OPS).text
    assert 'llmgw_retries_total{backend="flaky2",model="retried"} 2.0' in metrics


def test_no_retry_after_the_first_token_and_the_request_deadline_applies(guarded: tuple) -> None:
    url, state, _ = guarded
    raw = chat(url, "deadline", stream=True).text
    payloads = [p[6:] for p in raw.split("\n\n") if p.startswith("data: ")]
    assert json.loads(payloads[0])["choices"][0]["delta"]["content"] == "Start"
    error = json.loads(payloads[-2])["error"]
    assert payloads[-1] == "[DONE]" and error["type"] == "timeout_error" and "request_timeout" in error["message"]
    # the deadline ended it, by order: the whole answer is here while the upstream, 30 s from its second
    # chunk, has sent only its first
    [hung] = [r for r in state["hang"].requests if r.path == "/v1/chat/completions"]
    assert len(hung.sent_at) == 1 and not hung.answered
    assert len(state["hang"].sent("/v1/chat/completions")) == 1
    r = chat(url, "slow-with-deadline")  # before the first token (the upstream sleeps 1.5 s): 504
    assert r.status_code == 504 and "0.5 s limit" in openai_error(r)["message"]
    r = post(f"{url}/models/slow-with-deadline/generate", headers=OPS, json={"inputs": "Hi"})
    assert r.status_code == 504 and tgi_error(r)["error_type"] == "timeout"


def test_garbage_from_upstream_is_a_clean_error_and_the_gateway_stays_up(guarded: tuple) -> None:
    url, _, _ = guarded
    r = chat(url, "garbage")
    assert 500 < r.status_code < 600 and r.status_code != 500, r.text
    openai_error(r)
    raw = chat(url, "garbage", stream=True)
    assert raw.status_code in (200, 502) and "Traceback" not in raw.text
    assert chat(url, "other").status_code == 200


# client limits

def test_oversized_body_gets_413_in_the_protocols_shape(guarded: tuple) -> None:
    url, _, _ = guarded
    big = "x" * 30_000
    r = post(f"{url}/v1/chat/completions", headers=OPS,
             json={"model": "open", "messages": [{"role": "user", "content": big}]})
    assert r.status_code == 413 and openai_error(r)["type"] == "invalid_request_error"
    r = post(f"{url}/generate", headers=OPS, json={"inputs": big})
    assert r.status_code == 413 and tgi_error(r)["error_type"] == "payload_too_large"


def body_length(answer: bytes) -> int:
    head = answer.split(b"\r\n\r\n", 1)[0].decode().lower()
    return next((int(line.split(":", 1)[1]) for line in head.split("\r\n") if line.startswith("content-length:")), 0)


def read_answer(conn: socket.socket) -> str:
    """One whole HTTP answer, however the network splits it (head and body may come in separate reads)."""
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < body_length(answer):
        chunk = conn.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer.decode()


def test_a_client_that_sends_its_body_too_slowly_is_cut_off_with_408(guarded: tuple) -> None:
    url, _, _ = guarded
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=CLIENT_TIMEOUT) as conn:
        conn.sendall(f"POST /generate HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY_OPS}\r\n"
                     "content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"inp".encode())
        answer = read_answer(conn)  # the rest of the body never comes: only body_timeout answers this
    assert answer.startswith("HTTP/1.1 408")
    assert json.loads(answer.split("\r\n\r\n", 1)[1])["error_type"] == "request_timeout"


def test_a_client_that_stops_reading_is_cut_off_and_its_request_freed(guarded: tuple) -> None:
    url, upstreams, log = guarded
    firehose: ScriptedUpstream = upstreams["firehose"]
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "firehose", "stream": True, **CHAT}).encode()
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.connect((host, int(port)))
        conn.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY_OPS}\r\n"
                     f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
        # streaming into a client that reads nothing: the request reached the upstream, which streams on
        wait_until(lambda: any(r.path == "/v1/chat/completions" for r in firehose.requests), "the upstream called")
        wait_until(lambda: in_flight(url) == 0, "the request freed (send_timeout is 1 s)", interval=0.2)
        # ...while the client still holds its socket open, and never read the stream's end
        assert not any(r.answered for r in firehose.requests if r.path == "/v1/chat/completions")
    # the stream's cleanup ran (it gives back the admission, then closes the upstream request, which the
    # upstream notices at its next write)
    wait_until(lambda: firehose.broken_writes >= 1, "the upstream request closed")
    assert "client stopped reading" in log.read_text() and "Exception in ASGI application" not in log.read_text()


def in_flight(url: str) -> float:
    text = get(f"{url}/metrics", headers=OPS).text
    found = re.search(r'^llmgw_requests_in_flight{route="/v1/chat/completions"} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0
