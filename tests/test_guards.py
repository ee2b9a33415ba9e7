"""API keys, admission control, retries and timeouts, through a real gateway process in front of scripted
upstreams (tests/guarded_gateway.py)."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient

from tests import guarded_gateway
from tests.guarded_gateway import CHAT, KEY_A, KEY_OPS, KEY_T, OPS, auth, chat, get, openai_error, post, tgi_error
from tests.server import CLIENT_TIMEOUT, wait_until
from tests.upstream import Hold, ScriptedUpstream

guarded = guarded_gateway.guarded  # the module-scoped fixture: a gateway of this module's own

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
