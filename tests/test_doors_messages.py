"""Anthropic's Messages door end to end: the `anthropic` SDK against a real gateway serving the embedded
SmolLM2, behind an API key (which Anthropic's clients send as `x-api-key`). Raw bodies and stream events
are also checked strictly against the SDK's own (pydantic) types."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from prometheus_client.parser import text_string_to_metric_families
from pydantic import TypeAdapter

from tests.server import CLIENT_TIMEOUT, ENGINE_CONFIG, running_gateway, wait_until

KEY = "sk-doors-test"
CONFIG = ENGINE_CONFIG + f"""
[auth]
[[auth.keys]]
name = "doors"
key = "{KEY}"
"""
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # this SDK has no sampling arguments; the API still takes them
EVENTS = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Iterator[str]:
    with running_gateway(CONFIG, tmp_path_factory.mktemp("messages")) as u:
        yield u


@pytest.fixture(scope="module")
def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, timeout=CLIENT_TIMEOUT, max_retries=0)


def raw_stream(url: str, body: dict[str, Any]) -> list[Any]:
    """Each `event:` name equals its payload's `type`; payloads validated strictly against the SDK's types."""
    raw = httpx.post(f"{url}/v1/messages", json={**body, "stream": True}, timeout=CLIENT_TIMEOUT,
                     headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}).text
    events = []
    for frame in raw.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if not line.startswith(":"))
        if lines:
            payload = json.loads(lines["data"])
            assert lines["event"] == payload["type"]
            events.append(payload if payload["type"] == "ping" else EVENTS.validate_python(payload))
    return events


def test_create_and_stream_give_the_same_message(client: anthropic.Anthropic, url: str) -> None:
    whole = client.messages.create(model="smollm2", max_tokens=16, messages=CAPITAL, system="Answer briefly.",
                                   extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens <= 16
    with client.messages.stream(model="smollm2", max_tokens=16, messages=CAPITAL, system="Answer briefly.",
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    events = raw_stream(url, {"model": "smollm2", "max_tokens": 16, "messages": CAPITAL, "system": "Answer briefly.",
                              **GREEDY})
    kinds = [e["type"] if isinstance(e, dict) else e.type for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    delta = events[-2]
    assert (delta.delta.stop_reason, delta.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens


def test_a_tool_call_and_its_result(client: anthropic.Anthropic, url: str) -> None:
    first = client.messages.create(model="smollm2", max_tokens=60, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_weather" and u.id for u in uses)
    for u in uses:
        jsonschema.validate(u.input, WEATHER["input_schema"])
    with client.messages.stream(model="smollm2", max_tokens=60, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    assert streamed.stop_reason == "tool_use"
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": json.dumps({"temperature_c": 21})}
               for u in uses]
    second = client.messages.create(model="smollm2", max_tokens=24, tools=[WEATHER], tool_choice={"type": "none"},
                                    messages=[*ASK, {"role": "assistant", "content": first.content},
                                              {"role": "user", "content": results}], extra_body=GREEDY)
    assert [b.type for b in second.content] == ["text"] and second.stop_reason in ("end_turn", "max_tokens")


def test_stop_sequences_end_the_message_before_them(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="smollm2", max_tokens=40, messages=CAPITAL, stop_sequences=["Paris"],
                                   extra_body=GREEDY)
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", "Paris")
    assert "Paris" not in whole.content[0].text
    with client.messages.stream(model="smollm2", max_tokens=40, messages=CAPITAL, stop_sequences=["Paris"],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == \
        ("stop_sequence", "Paris", whole.content[0].text)


def test_count_tokens_is_the_prompt_a_message_uses(client: anthropic.Anthropic) -> None:
    for tools in ([], [WEATHER]):
        counted = client.messages.count_tokens(model="smollm2", messages=CAPITAL, tools=tools)
        used = client.messages.create(model="smollm2", max_tokens=1, messages=CAPITAL, tools=tools)
        assert counted.input_tokens == used.usage.input_tokens > 0


@pytest.mark.parametrize(("body", "words"), [
    ({"messages": CAPITAL}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"max_tokens": 4, "messages": CAPITAL, "tools": [{"name": "f", "input_schema": {"type": "nope"}}]},
     "input_schema"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                                                   "content": "1"}]}]}, "tool_use_id"),
    ({"max_tokens": 4, "messages": CAPITAL, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
], ids=["no-max-tokens", "image-block", "bad-tool-schema", "orphan-tool-result", "unknown-named-tool"])
def test_bad_input_gets_an_anthropic_400(url: str, body: dict[str, Any], words: str) -> None:
    r = httpx.post(f"{url}/v1/messages", json={"model": "smollm2", **body}, headers={"x-api-key": KEY},
                   timeout=CLIENT_TIMEOUT)
    error = r.json()
    assert r.status_code == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]


def test_keys_errors_and_the_sdk_agree_on_anthropics_shapes(client: anthropic.Anthropic, url: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:  # the SDK reads the error as Anthropic's
        client.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "document", "source": {}}]}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    bad = anthropic.Anthropic(base_url=url, api_key="wrong", timeout=CLIENT_TIMEOUT, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        bad.messages.create(model="smollm2", max_tokens=4, messages=CAPITAL)
    assert denied.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                            "message": "invalid API key"}}
    malformed = httpx.post(f"{url}/v1/messages", content=b"{not json", headers={"x-api-key": KEY,
                                                                                "content-type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.post(f"{url}/v1/messages/nope", json={}, headers={"x-api-key": KEY})
    assert missing.status_code in (404, 405) and missing.json()["type"] == "error"
    bearer = httpx.post(f"{url}/v1/messages", json={"model": "smollm2", "max_tokens": 2, "messages": CAPITAL},
                        headers={"authorization": f"Bearer {KEY}"}, timeout=CLIENT_TIMEOUT)
    Message.model_validate(bearer.json())
    bad_version = httpx.post(f"{url}/v1/messages", json={"model": "smollm2", "max_tokens": 2, "messages": CAPITAL},
                             headers={"x-api-key": KEY, "anthropic-version": "latest"}, timeout=CLIENT_TIMEOUT)
    assert bad_version.status_code == 400 and "anthropic-version" in bad_version.json()["error"]["message"]
    metrics = httpx.get(f"{url}/metrics", headers={"x-api-key": KEY}, timeout=CLIENT_TIMEOUT).text
    assert 'route="/v1/messages"' in metrics and 'route="/v1/messages/count_tokens"' in metrics


def engine_idle(url: str) -> bool:
    values = {s.name: s.value for family in text_string_to_metric_families(
        httpx.get(f"{url}/metrics", headers={"x-api-key": KEY}, timeout=CLIENT_TIMEOUT).text) for s in family.samples
        if s.labels.get("backend") == "local"}
    return bool(values.get("llmgw_engine_kv_blocks_total")) and values.get("llmgw_engine_kv_blocks_used") == 0 and \
        values.get("llmgw_engine_running_seqs") == 0


STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to paint."}]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"max_tokens": 400, "messages": STORY}),
    ("/v1/responses", {"max_output_tokens": 400, "input": STORY}),
], ids=["messages", "responses"])
def test_a_client_that_leaves_mid_stream_frees_its_kv_blocks(url: str, path: str, body: dict[str, Any]) -> None:
    wait_until(lambda: engine_idle(url), "the engine idle before the test")
    with httpx.stream("POST", f"{url}{path}", json={"model": "smollm2", "stream": True, **body, **GREEDY},
                      headers={"x-api-key": KEY}, timeout=CLIENT_TIMEOUT) as r:
        for line in r.iter_lines():
            if "delta" in line and line.startswith("data: "):
                break  # generation is under way; the client hangs up here
    wait_until(lambda: engine_idle(url), "every KV block free again after the client left")
