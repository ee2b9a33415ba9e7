"""OpenAI's Responses door end to end: the `openai` SDK against a real gateway serving the embedded SmolLM2.
Every body and stream event is also checked strictly against the SDK's own (pydantic) types."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from backends.base import ChatMessage
from gateway.protocol.responses import Response as ResponseObject
from gateway.protocol.responses import TextConfig
from gateway.responses_store import ResponsesStore
from tests.server import CLIENT_TIMEOUT

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
ASK = "What is the weather like in Paris today?"
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def client(gateway_url: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", timeout=CLIENT_TIMEOUT, max_retries=0)


def stream_events(gateway_url: str, body: dict[str, Any]) -> list[Any]:
    """The raw SSE stream: each `event:` name equals its payload's `type`; payloads validated strictly."""
    raw = httpx.post(f"{gateway_url}/v1/responses", json={**body, "stream": True}, timeout=CLIENT_TIMEOUT).text
    events = []
    for frame in raw.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if not line.startswith(":"))
        if lines:
            payload = json.loads(lines["data"])
            assert lines["event"] == payload["type"]
            events.append(EVENTS.validate_python(payload))
    return events


def test_plain_response_is_a_completed_message_with_usage(client: OpenAI, gateway_url: str) -> None:
    r = client.responses.create(model="smollm2", input="What is the capital of France?", max_output_tokens=16,
                                temperature=0, instructions="Answer briefly.")
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.output_text and r.output_text == message.content[0].text
    assert r.usage.output_tokens <= 16 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer briefly." and r.max_output_tokens == 16
    raw = httpx.get(f"{gateway_url}/v1/responses/{r.id}", timeout=CLIENT_TIMEOUT).json()
    Response.model_validate(raw, strict=False)  # every required field of the SDK's type is there
    paths = httpx.get(f"{gateway_url}/docs/openapi.json", timeout=CLIENT_TIMEOUT).json()["paths"]
    assert {"/v1/responses", "/v1/responses/{response_id}", "/v1/messages", "/v1/messages/count_tokens"} <= set(paths)


def test_stream_events_are_ordered_numbered_and_add_up_to_the_whole_answer(client: OpenAI, gateway_url: str) -> None:
    body = {"model": "smollm2", "input": "Name three colours.", "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**body)
    events = stream_events(gateway_url, body)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(**body) as stream:  # the SDK's own stream helper reads the same events
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == whole.output_text


def test_function_call_then_its_output_in_a_second_turn(client: OpenAI, gateway_url: str) -> None:
    first = client.responses.create(model="smollm2", input=ASK, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=60, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
    events = stream_events(gateway_url, {"model": "smollm2", "input": ASK, "tools": [WEATHER],
                                         "tool_choice": "required", "max_output_tokens": 60, "temperature": 0})
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    for d in done:  # each call's argument deltas add up to its arguments
        assert d.arguments == "".join(e.delta for e in events
                                      if e.type == "response.function_call_arguments.delta" and e.item_id == d.item_id)
    streamed = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    assert events[-1].type == "response.completed" and events[-1].response.output == streamed
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"temperature_c": 21})}
               for c in calls]
    second = client.responses.create(model="smollm2", input=[{"role": "user", "content": ASK}, *first.output, *outputs],
                                     tools=[WEATHER], tool_choice="none", max_output_tokens=24, temperature=0)
    assert [o.type for o in second.output] == ["message"] and second.output_text


def test_text_format_json_schema_shapes_the_output(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.responses.create(model="smollm2", input="Name a city and its country.", max_output_tokens=60,
                                temperature=0, text={"format": {"type": "json_schema", "name": "place",
                                                                "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "place"


def test_stored_responses_continue_and_can_be_deleted(client: OpenAI, gateway_url: str) -> None:
    first = client.responses.create(model="smollm2", input="My favourite colour is green.", max_output_tokens=12,
                                    temperature=0)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    follow = client.responses.create(model="smollm2", previous_response_id=first.id, input="What is my favourite "
                                     "colour?", max_output_tokens=12, temperature=0)
    # the same conversation sent whole gives the same (greedy) answer: the stored turn was continued
    spelled = client.responses.create(model="smollm2", max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": "My favourite colour is green."}, {"role": "assistant", "content":
                                                                       first.output_text},
        {"role": "user", "content": "What is my favourite colour?"}])
    assert follow.output_text == spelled.output_text and follow.previous_response_id == first.id
    assert follow.usage.input_tokens == spelled.usage.input_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="smollm2", previous_response_id=first.id, input="Hi", max_output_tokens=2)
    unstored = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    metrics = httpx.get(f"{gateway_url}/metrics", timeout=CLIENT_TIMEOUT).text
    assert 'route="/v1/responses"' in metrics and 'route="/v1/responses/{id}"' in metrics  # ids folded away
    assert first.id not in metrics


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]},
     "tools[0].parameters"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id"),
    ({"input": "Hi", "tool_choice": {"type": "function", "name": "f"}, "tools": [WEATHER]}, "tool_choice"),
], ids=["unknown-item", "bad-tool-schema", "unknown-tool-type", "orphan-output", "unknown-named-tool"])
def test_bad_input_gets_an_openai_400(client: OpenAI, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="smollm2", max_output_tokens=4, **body)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "invalid_request_error" and error["param"] == param


def test_the_store_is_bounded_expires_and_keeps_each_entry_to_its_key() -> None:
    now = [0.0]
    store = ResponsesStore(capacity=2, ttl=60.0, clock=lambda: now[0])

    def response(n: int) -> ResponseObject:
        return ResponseObject(id=f"resp_{n:032x}", created_at=0.0, model="m", status="completed", output=[], tools=[],
                              tool_choice="auto", parallel_tool_calls=True, text=TextConfig())

    for n in range(3):
        store.put(response(n), [ChatMessage(role="user", content=str(n))], owner="team-a")
    assert len(store) == 2 and store.get(response(0).id, "team-a") is None  # the oldest went first
    assert store.get(response(1).id, "team-a").conversation[0].content == "1"
    assert store.get(response(1).id, "team-b") is None and not store.delete(response(1).id, "team-b")
    now[0] = 61.0
    assert store.get(response(2).id, "team-a") is None and len(store) == 0  # expired
