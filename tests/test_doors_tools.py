"""Tool calling through the OpenAI door, end to end: the `openai` SDK and huggingface_hub's
InferenceClient against a real gateway serving the embedded SmolLM2, which the gateway drives itself
(tools in the prompt, `required` and named calls forced by a JSON-schema constraint, `auto` parsed)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI

from tests.spec import validate

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def client(gateway_url: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def assert_valid_calls(calls: list[Any], allowed: set[str]) -> None:
    """Each call names a given tool, and its arguments are a JSON text that tool's schema admits."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def test_required_forces_a_valid_call(client: OpenAI) -> None:
    resp = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_tokens=120)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert_valid_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def test_named_tool_is_the_one_called_and_finishes_with_stop(client: OpenAI) -> None:
    resp = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, temperature=0, max_tokens=120,
                                          tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"  # vLLM's: a forced named call is a plain stop
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls, {"get_time"})


def test_required_streams_calls_in_openai_chunks(gateway_url: str) -> None:
    raw = httpx.post(f"{gateway_url}/v1/chat/completions", timeout=TIMEOUT, json={
        "model": "smollm2", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
        "max_tokens": 120, "stream": True}).text
    payloads = [p[6:] for p in raw.split("\n\n") if p.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    for c in chunks:
        validate("openai", "CreateChatCompletionStreamResponse", c)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    pieces = [t for d in deltas for t in d.get("tool_calls", [])]
    assert all(d["content"] is None for d in deltas)  # no markup, no text: only calls
    first = pieces[0]
    assert set(first) == {"index", "id", "type", "function"} and first["function"]["arguments"] == ""
    assert first["type"] == "function" and first["id"].startswith("call_") and first["index"] == 0
    headers = [p for p in pieces if "id" in p]
    for p in pieces:
        if "id" not in p:
            assert set(p) == {"index", "function"} and set(p["function"]) == {"arguments"}
    calls = {h["index"]: [h["function"]["name"], ""] for h in headers}
    for p in pieces:
        calls[p["index"]][1] += p["function"]["arguments"]
    for name, arguments in calls.values():
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_streamed_and_whole_calls_agree(client: OpenAI) -> None:
    kw: dict[str, Any] = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                              max_tokens=120)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    args: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for t in chunk.choices[0].delta.tool_calls or []:
            entry = args.setdefault(t.index, ["", ""])
            entry[0] += t.function.name or ""
            entry[1] += t.function.arguments or ""
    assert [(c.function.name, c.function.arguments) for c in whole] == [tuple(args[i]) for i in sorted(args)]


def test_parallel_tool_calls_false_makes_one_call(client: OpenAI) -> None:
    resp = client.chat.completions.create(model="smollm2", tools=TOOLS, tool_choice="required", temperature=0,
                                          parallel_tool_calls=False, max_tokens=120, messages=[
                                              {"role": "user", "content": "Weather in Paris and the time in Tokyo?"}])
    assert len(resp.choices[0].message.tool_calls) == 1
    assert_valid_calls(resp.choices[0].message.tool_calls, {"get_weather", "get_time"})


def test_a_length_cut_stays_length(client: OpenAI) -> None:
    resp = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_tokens=6)
    assert resp.choices[0].finish_reason == "length"


def test_none_leaves_the_tools_out_of_the_prompt(client: OpenAI) -> None:
    plain = client.chat.completions.create(model="smollm2", messages=ASK, temperature=0, max_tokens=30)
    none = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=30)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None and none.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_answers_with_text_or_calls(client: OpenAI, stream: bool) -> None:
    kw: dict[str, Any] = dict(model="smollm2", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls or [], choice.finish_reason
    else:
        content, names, finish = "", [], None
        for chunk in client.chat.completions.create(**kw, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            names += [t.function.name for t in delta.tool_calls or [] if t.function.name]
            finish = chunk.choices[0].finish_reason or finish
        calls = names
    assert "<tool_call>" not in (content or "")
    assert finish == ("tool_calls" if calls else finish) and finish in ("stop", "length", "tool_calls")
    assert calls or content


def test_multi_turn_with_tool_results(client: OpenAI) -> None:
    first = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=120).choices[0].message
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in first.tool_calls]}]
    history += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature_c": 21, "sky": "clear"})}
                for c in first.tool_calls]
    answer = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, temperature=0,
                                            max_tokens=40, tool_choice="none")
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", messages=history, tools=TOOLS, temperature=0, max_tokens=40, tool_choice="none",
        stream=True))
    assert streamed == answer.choices[0].message.content
    again = client.chat.completions.create(model="smollm2", messages=[*history, {"role": "user", "content":
                                                                                 "And in Rome?"}],
                                           tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    assert_valid_calls(again.choices[0].message.tool_calls, {"get_weather", "get_time"})


def test_whole_answer_with_calls_matches_the_spec(gateway_url: str) -> None:
    body = httpx.post(f"{gateway_url}/v1/chat/completions", timeout=TIMEOUT, json={
        "model": "smollm2", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
        "max_tokens": 120}).json()
    message = body["choices"][0]["message"]
    for call in message["tool_calls"]:  # the excerpt leaves the custom-call schema out, which breaks its oneOf
        validate("openai", "ChatCompletionMessageToolCall", call)
    validate("openai", "CreateChatCompletionResponse", {**body, "choices": [
        {**body["choices"][0], "message": {k: v for k, v in message.items() if k != "tool_calls"}}]})
    assert message["content"] is None and message["tool_calls"][0]["type"] == "function"
    plain = httpx.post(f"{gateway_url}/v1/chat/completions", timeout=TIMEOUT, json={
        "model": "smollm2", "messages": ASK, "max_tokens": 2}).json()
    assert "tool_calls" not in plain["choices"][0]["message"]  # no calls: the key is left out


def test_inference_client_chat_with_tools(gateway_url: str) -> None:
    client = InferenceClient(base_url=gateway_url, timeout=TIMEOUT)
    out = client.chat_completion(messages=ASK, model="smollm2", tools=TOOLS, tool_choice="required", max_tokens=120,
                                 temperature=0)
    calls = out.choices[0].message.tool_calls
    assert calls and out.choices[0].finish_reason == "tool_calls"
    for call in calls:
        arguments = call.function.arguments
        jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments,
                            SCHEMAS[call.function.name])
    named = client.chat_completion(messages=ASK, model="smollm2", tools=TOOLS, max_tokens=120, temperature=0,
                                   tool_choice={"function": {"name": "get_weather"}})
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_weather"]
