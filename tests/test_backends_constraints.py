"""Remote backends with output constraints and tools, against recorded TGI and trtllm-serve traffic
(tests/recordings_tools.py): the exact fields each sends upstream, what it makes of the replies, and
what each refuses before any upstream call."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import msgspec
import pytest

from backends.base import (
    BackendValidationError,
    ChatMessage,
    FinishReason,
    GenerationRequest,
    OutputConstraint,
    TokenEvent,
    ToolCall,
    ToolChoice,
    ToolFunction,
)
from backends.openai import OpenAIBackend, OpenAISettings
from backends.tgi import TgiBackend, TgiSettings
from backends.triton import TritonBackend, TritonSettings
from tests.recordings import openai_text_routes, triton_ensemble_routes
from tests.recordings_tools import (
    CALL_TEXT,
    JSON_TEXT,
    WEATHER,
    fold_tool_calls,
    tgi_grammar_routes,
    trtllm_tool_routes,
)
from tests.server import CLIENT_TIMEOUT, running_gateway
from tests.upstream import ScriptedUpstream, scripted_upstream

CHAT = [ChatMessage(role="user", content="Weather in Paris?")]
TOOLS = [ToolFunction(name="get_weather", description="Current weather", parameters=WEATHER),
         ToolFunction(name="get_time", parameters={"type": "object", "properties": {"zone": {"type": "string"}}})]
KINDS = {
    "json_schema": OutputConstraint(kind="json_schema", json_schema=WEATHER, name="weather", strict=True),
    "json_object": OutputConstraint(kind="json_object"),
    "regex": OutputConstraint(kind="regex", regex=r"\d{3}"),
    "choice": OutputConstraint(kind="choice", choices=["yes", "no?", "a.b c"]),
    "grammar": OutputConstraint(kind="grammar", grammar='root ::= "yes" | "no"'),
}
CHOICE_REGEX = r"(?:yes|no\?|a\.b c)"
# trtllm-serve refuses unknown fields (pydantic extra="forbid")
TRTLLM_FIELDS = {"model", "messages", "prompt", "max_tokens", "temperature", "top_p", "stream", "stream_options",
                 "stop", "seed", "response_format", "tools", "tool_choice", "parallel_tool_calls"}


def request(**kw: Any) -> GenerationRequest:
    return GenerationRequest(request_id="r1", model="m", **{"max_new_tokens": 16, **kw})


async def collect(backend: Any, r: GenerationRequest, close: bool = True) -> list[TokenEvent]:
    try:
        return [e async for e in backend.generate(r)]
    finally:
        if close:
            await backend.aclose()


def trtllm(upstream: ScriptedUpstream, **kw: Any) -> OpenAIBackend:
    return OpenAIBackend("trt", OpenAISettings(base_url=upstream.url, model="llama", flavor="trtllm", **kw))


# TGI


@pytest.mark.parametrize("prompt_logprobs", [False, True], ids=["generate_stream", "generate"])
async def test_tgi_json_schema_becomes_its_grammar_on_generate(prompt_logprobs: bool) -> None:
    with scripted_upstream(tgi_grammar_routes()) as up:
        events = await collect(TgiBackend("tgi", TgiSettings(base_url=up.url)),
                               request(prompt="Weather?", constraint=KINDS["json_schema"],
                                       prompt_logprobs=prompt_logprobs))
    [sent] = up.sent("/generate" if prompt_logprobs else "/generate_stream")
    assert sent["parameters"]["grammar"] == {"type": "json", "value": WEATHER}
    assert "".join(e.text for e in events) == JSON_TEXT and json.loads(JSON_TEXT)["city"] == "Paris"
    assert events[-1].finish_reason == FinishReason.EOS_TOKEN


@pytest.mark.parametrize(("kind", "value"), [("regex", r"\d{3}"), ("choice", CHOICE_REGEX)])
async def test_tgi_regex_and_choice_become_a_regex_grammar(kind: str, value: str) -> None:
    with scripted_upstream(tgi_grammar_routes()) as up:
        await collect(TgiBackend("tgi", TgiSettings(base_url=up.url)), request(prompt="x", constraint=KINDS[kind]))
    assert up.sent("/generate_stream")[0]["parameters"]["grammar"] == {"type": "regex", "value": value}


async def test_tgi_chat_gets_response_format_in_tgi_form() -> None:
    with scripted_upstream(tgi_grammar_routes()) as up:
        events = await collect(TgiBackend("tgi", TgiSettings(base_url=up.url)),
                               request(messages=CHAT, constraint=KINDS["json_schema"]))
    [sent] = up.sent("/v1/chat/completions")
    assert sent["response_format"] == {"type": "json", "value": WEATHER}  # not OpenAI's json_schema wrapper
    assert "".join(e.text for e in events) == JSON_TEXT and events[-1].usage.completion_tokens == 5


async def test_tgi_gets_a_schema_without_top_level_properties_as_its_regex() -> None:
    """TGI 422s such schemas; the gateway's forced tool calls are one (a list). Compiled here with
    outlines-core, as TGI's router compiles the schemas it takes."""
    calls = {"type": "array", "minItems": 1, "maxItems": 1, "items": {
        "type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]}, "arguments": WEATHER},
        "required": ["name", "arguments"], "additionalProperties": False}}
    with scripted_upstream(tgi_grammar_routes()) as up:
        events = await collect(TgiBackend("tgi", TgiSettings(base_url=up.url)), request(
            messages=CHAT, constraint=OutputConstraint(kind="json_schema", json_schema=calls, name="tool_calls")))
    grammar = up.sent("/v1/chat/completions")[0]["response_format"]
    assert grammar["type"] == "regex"
    text = "".join(e.text for e in events)
    assert text == CALL_TEXT and re.fullmatch(grammar["value"], text)
    assert re.fullmatch(grammar["value"], '[{"name": "get_weather", "arguments": {"city": "Lyon"}}]')
    assert not re.fullmatch(grammar["value"], '[{"name": "get_time", "arguments": {"city": "Lyon"}}]')
    assert not re.fullmatch(grammar["value"], '{"name": "get_weather", "arguments": {"city": "Lyon"}}')


@pytest.mark.parametrize(("r", "needle"), [
    (request(prompt="x", constraint=OutputConstraint(kind="json_schema", json_schema={"not": {"type": "string"}})),
     "cannot be compiled to the regex TGI needs"),
    (request(prompt="x", constraint=KINDS["json_object"]), "cannot enforce a 'json_object'"),
    (request(messages=CHAT, constraint=KINDS["grammar"]), "cannot enforce a 'grammar'"),
    (request(messages=CHAT, tools=TOOLS), "does not take tools"),
    (request(messages=[ChatMessage(role="assistant", content=None, tool_calls=[
        ToolCall(id="c1", name="get_weather", arguments="{}")])]), "does not take tools"),
], ids=["uncompilable-schema", "json_object", "grammar", "tools", "tool-call-message"])
async def test_tgi_refuses_what_it_cannot_enforce_before_calling_upstream(r: GenerationRequest,
                                                                          needle: str) -> None:
    with scripted_upstream(tgi_grammar_routes()) as up:
        backend = TgiBackend("tgi", TgiSettings(base_url=up.url))
        assert backend.info().constraint_kinds == {"json_schema", "regex", "choice"}
        assert backend.info().native_tools is False
        with pytest.raises(BackendValidationError, match="'tgi'") as refused:
            await collect(backend, r)
    assert needle in refused.value.message and up.requests == []


# trtllm-serve


@pytest.mark.parametrize(("kind", "form"), [
    ("json_schema", {"type": "json", "schema": WEATHER}), ("json_object", {"type": "json_object"}),
    ("regex", {"type": "regex", "regex": r"\d{3}"}), ("choice", {"type": "regex", "regex": CHOICE_REGEX}),
    ("grammar", {"type": "ebnf", "ebnf": 'root ::= "yes" | "no"'})])
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_trtllm_gets_its_own_response_format_on_both_routes(kind: str, form: dict, route: str) -> None:
    with scripted_upstream(trtllm_tool_routes()) as up:
        r = request(messages=CHAT) if route == "chat" else request(prompt="Weather?")
        r.constraint = KINDS[kind]
        events = await collect(trtllm(up), r)
    [sent] = up.sent(f"/v1/{'chat/' if route == 'chat' else ''}completions")
    assert sent["response_format"] == form and set(sent) <= TRTLLM_FIELDS
    assert "".join(e.text for e in events) == JSON_TEXT and events[-1].usage.prompt_tokens == 12


async def test_trtllm_streamed_tool_calls_are_normalised_deltas() -> None:
    with scripted_upstream(trtllm_tool_routes()) as up:
        events = await collect(trtllm(up), request(messages=CHAT, tools=TOOLS, tool_choice=ToolChoice(mode="auto")))
    [sent] = up.sent("/v1/chat/completions")
    assert sent["tools"][0] == {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather", "parameters": WEATHER}}
    assert sent["tool_choice"] == "auto" and set(sent) <= TRTLLM_FIELDS
    assert "parallel_tool_calls" not in sent  # older trtllm-serve refuses the field; true is what it does anyway
    calls = fold_tool_calls(events)
    assert [(c["id"], c["name"]) for c in calls.values()] == [("chatcmpl-tool-6f1c2a", "get_weather"),
                                                              ("chatcmpl-tool-9b0d4e", "get_time")]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"} and json.loads(calls[1]["arguments"])
    assert events[-1].finish_reason == FinishReason.TOOL_CALLS and events[-1].usage.completion_tokens == 8
    assert all(e.text == "" for e in events)


async def test_parallel_tool_calls_false_keeps_only_the_first_call() -> None:
    with scripted_upstream(trtllm_tool_routes()) as up:
        events = await collect(trtllm(up), request(messages=CHAT, tools=TOOLS, parallel_tool_calls=False))
    assert up.sent("/v1/chat/completions")[0]["parallel_tool_calls"] is False
    assert list(fold_tool_calls(events)) == [0]  # trtllm-serve accepts the flag but does not enforce it


async def test_trtllm_named_tool_stream_repeats_the_name_and_has_no_id() -> None:
    with scripted_upstream(trtllm_tool_routes()) as up:
        events = await collect(trtllm(up), request(messages=CHAT, tools=TOOLS,
                                                   tool_choice=ToolChoice(mode="function", function="get_weather")))
    assert up.sent("/v1/chat/completions")[0]["tool_choice"] == {"type": "function", "function": {
        "name": "get_weather"}}
    [call] = fold_tool_calls(events).values()
    assert call["name"] == "get_weather" and call["id"].startswith("call_")  # made up: trtllm sent none
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert events[-1].finish_reason == FinishReason.EOS_TOKEN  # a named call ends with "stop"; the door decides


@pytest.mark.parametrize("named", [False, True], ids=["auto", "named"])
async def test_trtllm_whole_answer_tool_calls_become_deltas(named: bool) -> None:
    choice = ToolChoice(mode="function", function="get_weather") if named else ToolChoice(mode="required")
    with scripted_upstream(trtllm_tool_routes()) as up:
        events = await collect(trtllm(up), request(messages=CHAT, tools=TOOLS, tool_choice=choice, stream=False))
    assert up.sent("/v1/chat/completions")[0]["stream"] is False
    calls = fold_tool_calls(events)
    assert [c["name"] for c in calls.values()] == (["get_weather"] if named else ["get_weather", "get_time"])
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"} and calls[0]["id"] == "chatcmpl-tool-6f1c2a"
    assert events[-1].finish_reason == (FinishReason.EOS_TOKEN if named else FinishReason.TOOL_CALLS)


async def test_tool_turns_in_the_history_go_in_openai_form() -> None:
    history = CHAT + [ChatMessage(role="assistant", content=None, tool_calls=[
        ToolCall(id="call_1", name="get_weather", arguments='{"city":"Paris"}')]),
        ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1")]
    with scripted_upstream(trtllm_tool_routes()) as up:
        await collect(trtllm(up), request(messages=history, tools=TOOLS))
    assert up.sent("/v1/chat/completions")[0]["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}]


# vLLM and generic OpenAI servers: the body only (real vLLM answers in tests/test_vllm_upstream.py)


@pytest.mark.parametrize(("kind", "fields"), [
    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "weather", "schema": WEATHER, "strict": True}}}),
    ("json_object", {"response_format": {"type": "json_object"}}),
    ("regex", {"structured_outputs": {"regex": r"\d{3}"}}),
    ("choice", {"structured_outputs": {"choice": ["yes", "no?", "a.b c"]}}),
    ("grammar", {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})])
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_vllm_gets_response_format_or_structured_outputs_never_guided(kind: str, fields: dict,
                                                                            route: str) -> None:
    with scripted_upstream(openai_text_routes("yes")) as up:
        r = request(messages=CHAT) if route == "chat" else request(prompt="Weather?")
        r.constraint = KINDS[kind]
        await collect(OpenAIBackend("v", OpenAISettings(base_url=up.url, model="m", flavor="vllm")), r)
    [sent] = up.sent(f"/v1/{'chat/' if route == 'chat' else ''}completions")
    assert {k: sent[k] for k in fields} == fields
    assert not [k for k in sent if k.startswith("guided_")]  # vLLM >= 0.12 ignores those without a word


async def test_vllm_sends_parallel_tool_calls_and_no_tool_fields_without_tools() -> None:
    with scripted_upstream(openai_text_routes("hi")) as up:
        backend = OpenAIBackend("v", OpenAISettings(base_url=up.url, model="m", flavor="vllm"))
        await collect(backend, request(messages=CHAT, tools=TOOLS, tool_choice=ToolChoice(mode="required")), False)
        await collect(backend, request(messages=CHAT, tool_choice=ToolChoice(mode="none")))
    with_tools, without = up.sent("/v1/chat/completions")
    assert with_tools["tool_choice"] == "required" and with_tools["parallel_tool_calls"] is True
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(without)  # vLLM refuses `tools: []`


@pytest.mark.parametrize(("settings", "r", "needle"), [
    ({"flavor": "generic"}, request(messages=CHAT, constraint=KINDS["regex"]), "cannot enforce a 'regex'"),
    ({"flavor": "vllm", "constraint_kinds": ["json_schema"]}, request(prompt="x", constraint=KINDS["choice"]),
     "cannot enforce a 'choice'"),
    ({"flavor": "vllm", "native_tools": False}, request(messages=CHAT, tools=TOOLS), "does not take tools"),
    ({"flavor": "vllm"}, request(prompt="x", tools=TOOLS), "does not take tools"),  # /v1/completions has none
], ids=["generic-regex", "configured-kinds", "native-tools-off", "completions-tools"])
async def test_openai_backend_refuses_before_calling_upstream(settings: dict, r: GenerationRequest,
                                                              needle: str) -> None:
    with scripted_upstream(openai_text_routes("hi")) as up:
        with pytest.raises(BackendValidationError, match="'v'") as refused:
            await collect(OpenAIBackend("v", OpenAISettings(base_url=up.url, model="m", **settings)), r)
    assert needle in refused.value.message and up.requests == []


def test_openai_constraint_kinds_per_flavor_and_config() -> None:
    def info(**kw: Any) -> Any:
        return OpenAIBackend("v", OpenAISettings(base_url="http://x", model="m", **kw)).info()

    assert info(flavor="vllm").constraint_kinds == info(flavor="trtllm").constraint_kinds == set(KINDS)
    assert info().constraint_kinds == {"json_schema", "json_object"} and info().native_tools is True
    assert info(flavor="trtllm", constraint_kinds=[]).constraint_kinds == set()
    with pytest.raises(msgspec.ValidationError, match="no wire form for flavor 'generic'"):
        msgspec.convert({"type": "openai", "base_url": "http://x", "model": "m", "constraint_kinds": ["regex"]},
                        OpenAISettings)


# Triton


@pytest.mark.parametrize("r", [request(prompt="x", constraint=KINDS["json_schema"]),
                               request(prompt="x", tools=TOOLS)], ids=["constraint", "tools"])
async def test_triton_refuses_constraints_and_tools_before_calling_upstream(r: GenerationRequest) -> None:
    with scripted_upstream(triton_ensemble_routes()) as up:
        backend = TritonBackend("trit", TritonSettings(base_url=up.url))
        assert backend.info().constraint_kinds == set() and backend.info().native_tools is False
        with pytest.raises(BackendValidationError, match="'trit' \\(triton\\)"):
            await collect(backend, r)
    assert up.requests == []


# through the doors: a gateway with the recorded upstreams


@pytest.fixture(scope="module")
def doors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, ScriptedUpstream]]]:
    with ExitStack() as stack:
        ups = {name: stack.enter_context(scripted_upstream(routes)) for name, routes in
               [("trt", trtllm_tool_routes()), ("tgi", tgi_grammar_routes()), ("triton", triton_ensemble_routes())]}
        config = (f'default_model = "m-tgi"\n\n[backends.trt]\ntype = "openai"\nbase_url = "{ups["trt"].url}"\n'
                  f'model = "llama"\nflavor = "trtllm"\n\n'
                  f'[backends.tgi]\ntype = "tgi"\nbase_url = "{ups["tgi"].url}"\n\n'
                  f'[backends.triton]\ntype = "triton"\nbase_url = "{ups["triton"].url}"\n'
                  f'chat_template = "{{% for m in messages %}}{{{{ m.content }}}}{{% endfor %}}"\n\n'
                  + "".join(f'[models.m-{n}]\nbackend = "{n}"\n\n' for n in ups))
        yield stack.enter_context(running_gateway(config, tmp_path_factory.mktemp("doors"), wait_healthy=False)), ups


def door_chat(url: str, model: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": [
        {"role": "user", "content": "Weather in Paris?"}], **body}, timeout=CLIENT_TIMEOUT)


WIRE_TOOLS = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in TOOLS]


def test_door_relays_trtllm_tool_calls(doors: tuple[str, dict]) -> None:
    url, ups = doors
    whole = door_chat(url, "m-trt", tools=WIRE_TOOLS).json()["choices"][0]
    assert [(c["id"], c["function"]["name"]) for c in whole["message"]["tool_calls"]] == [
        ("chatcmpl-tool-6f1c2a", "get_weather"), ("chatcmpl-tool-9b0d4e", "get_time")]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert ups["trt"].sent("/v1/chat/completions")[-1]["tools"] == WIRE_TOOLS
    raw = door_chat(url, "m-trt", tools=WIRE_TOOLS, stream=True).text
    chunks = [json.loads(p[6:]) for p in raw.split("\n\n") if p.startswith("data: {")]
    deltas = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert "".join(d["function"]["arguments"] for d in deltas if d["index"] == 0) == '{"city": "Paris"}'
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] \
        == ["tool_calls"]


def test_door_response_format_reaches_trtllm_and_tgi_in_their_forms(doors: tuple[str, dict]) -> None:
    url, ups = doors
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    for model in ("m-trt", "m-tgi"):
        r = door_chat(url, model, response_format=fmt, stream=True)
        assert r.status_code == 200, r.text
    assert ups["trt"].sent("/v1/chat/completions")[-1]["response_format"] == {"type": "json", "schema": WEATHER}
    assert ups["tgi"].sent("/v1/chat/completions")[-1]["response_format"] == {"type": "json", "value": WEATHER}


def test_door_tgi_grammar_and_forced_tool_calls(doors: tuple[str, dict]) -> None:
    url, ups = doors
    grammar = {"type": "json", "value": WEATHER}
    body = httpx.post(f"{url}/models/m-tgi/generate", json={"inputs": "Weather?", "parameters": {
        "grammar": grammar}}, timeout=CLIENT_TIMEOUT).json()
    assert body["generated_text"] == JSON_TEXT
    assert ups["tgi"].sent("/generate_stream")[-1]["parameters"]["grammar"] == grammar
    # `required` over TGI: the gateway's own tool calling, its list-of-calls schema sent as a regex
    answer = door_chat(url, "m-tgi", tools=WIRE_TOOLS, tool_choice="required").json()["choices"][0]
    [call] = answer["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Paris"})
    sent = ups["tgi"].sent("/v1/chat/completions")[-1]
    assert sent["response_format"]["type"] == "regex" and "tools" not in sent
    assert re.fullmatch(sent["response_format"]["value"], CALL_TEXT)


@pytest.mark.parametrize(("model", "body"), [
    ("m-triton", {"response_format": {"type": "json_object"}}),
    ("m-tgi", {"response_format": {"type": "json_object"}}),
    ("m-triton", {"tools": WIRE_TOOLS, "tool_choice": "required"})], ids=["triton", "tgi-json-object", "triton-tools"])
def test_door_refuses_what_the_backend_cannot_enforce(doors: tuple[str, dict], model: str, body: dict) -> None:
    url, ups = doors
    before = {n: len(u.requests) for n, u in ups.items()}
    r = door_chat(url, model, **body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert {n: len(u.requests) for n, u in ups.items()} == before  # nothing reached an upstream
