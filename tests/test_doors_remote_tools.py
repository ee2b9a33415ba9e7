"""Tools and constraints through the OpenAI and TGI doors to remote backends (scripted upstreams):
a Triton backend, which takes neither (the gateway renders tools into the prompt and parses the calls
out of its text, and refuses constraints before any upstream call), and a vLLM backend with native
tools (tools, choice and history pass through; its tool-call deltas come back as OpenAI chunks)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
from openai import OpenAI

from backends.base import ConstraintKind
from backends.triton import TritonBackend, TritonSettings
from tests.server import running_gateway
from tests.upstream import Reply, ScriptedUpstream, by_stream, scripted_upstream, sse

TIMEOUT = 120.0
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}<assistant>"
PIECES = ["I will check.", "\n<tool", '_call>[{"name": "get_', 'weather", "arguments": {"city": ', '"Paris"}}]',
          "</tool_call>"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def triton_routes() -> dict:
    events = [{"model_name": "ensemble", "model_version": "1", "text_output": p, "num_input_tokens": 9,
               "num_output_tokens": i + 1} for i, p in enumerate(PIECES)]
    return {("GET", "/v2/models/ensemble/ready"): Reply([], 200, "text/plain"),
            ("POST", "/v2/models/ensemble/generate_stream"): Reply([sse(*events, crlf=True)])}


def vllm_routes() -> dict:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "llama"}
    call = {"id": "chatcmpl-tool-abc", "type": "function", "index": 0, "function": {"name": "get_weather"}}
    deltas = [{"role": "assistant", "content": ""}, {"tool_calls": [call]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}]
    chunks = [{**base, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}]} for d in deltas]
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}]})
    chunks.append({**base, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}})
    whole = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "llama", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "chatcmpl-tool-abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}}
    return {("GET", "/v1/models"): Reply([b'{"data": [{"id": "llama"}]}'], 200, "application/json"),
            ("POST", "/v1/chat/completions"): by_stream(Reply([sse(*chunks, b"[DONE]")]),
                                                        Reply([json.dumps(whole).encode()], 200, "application/json"))}


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ScriptedUpstream, ScriptedUpstream]]:
    with ExitStack() as stack:
        triton = stack.enter_context(scripted_upstream(triton_routes()))
        vllm = stack.enter_context(scripted_upstream(vllm_routes()))
        config = (f'default_model = "m-trt"\n\n[backends.trt]\ntype = "triton"\nbase_url = "{triton.url}"\n'
                  f"chat_template = {json.dumps(TEMPLATE)}\n\n[models.m-trt]\nbackend = \"trt\"\n\n"
                  f'[backends.vllm]\ntype = "openai"\nbase_url = "{vllm.url}"\nmodel = "llama"\nflavor = "vllm"\n\n'
                  '[models.m-vllm]\nbackend = "vllm"\n')
        url = stack.enter_context(running_gateway(config, tmp_path_factory.mktemp("remote-tools")))
        yield url, triton, vllm


def test_triton_auto_tools_are_prompted_and_parsed(remote: tuple[str, ScriptedUpstream, ScriptedUpstream]) -> None:
    url, triton, _ = remote
    client = OpenAI(base_url=f"{url}/v1", api_key="x", timeout=TIMEOUT, max_retries=0)
    choice = client.chat.completions.create(model="m-trt", messages=ASK, tools=[WEATHER], max_tokens=50).choices[0]
    assert choice.message.content == "I will check." and choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = triton.sent("/v2/models/ensemble/generate_stream")[-1]["text_input"]
    assert prompt.startswith("<system>You are an expert in composing functions.") and '"get_weather"' in prompt
    content, pieces = "", []
    for chunk in client.chat.completions.create(model="m-trt", messages=ASK, tools=[WEATHER], max_tokens=50,
                                                stream=True):
        content += chunk.choices[0].delta.content or ""
        pieces += chunk.choices[0].delta.tool_calls or []
    assert content == "I will check." and "".join(p.function.arguments or "" for p in pieces) == '{"city": "Paris"}'
    assert pieces[0].id and pieces[0].function.name == "get_weather" and pieces[0].function.arguments == ""


def test_triton_gets_the_tool_history_as_text(remote: tuple[str, ScriptedUpstream, ScriptedUpstream]) -> None:
    url, triton, _ = remote
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=TIMEOUT, json={
        "model": "m-trt", "messages": history, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 50})
    assert r.status_code == 200, r.text
    prompt = triton.sent("/v2/models/ensemble/generate_stream")[-1]["text_input"]
    assert "<assistant><tool_call>[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]</tool_call>" \
           "</assistant>" in prompt
    assert "<user><tool_response>\nsunny\n</tool_response></user>" in prompt and "<tools>" not in prompt
    # `none`: the answer's text is not parsed, markup and all
    assert "<tool_call>" in r.json()["choices"][0]["message"]["content"]


def _unenforced() -> ConstraintKind | None:
    kinds = TritonBackend("t", TritonSettings(base_url="http://127.0.0.1:9")).info().constraint_kinds
    return next((k for k in ("json_schema", "regex") if k not in kinds), None)  # type: ignore[return-value]


def test_constraints_the_backend_cannot_enforce_are_refused_first(
        remote: tuple[str, ScriptedUpstream, ScriptedUpstream]) -> None:
    url, triton, _ = remote
    kind = _unenforced()
    if kind is None:
        pytest.skip("this Triton backend enforces JSON schemas and regexes")
    sent = len(triton.requests)
    grammar = {"type": "json", "value": {"properties": {"a": {"type": "string"}}}} if kind == "json_schema" else \
        {"type": "regex", "value": "a+"}
    tgi = httpx.post(f"{url}/generate", json={"inputs": "x", "parameters": {"grammar": grammar}}, timeout=TIMEOUT)
    assert tgi.status_code == 422 and tgi.json()["error"].startswith(
        f"Input validation error: grammar is not supported: a {kind} grammar cannot be enforced by backend 'trt' "
        "(triton)")
    stream = httpx.post(f"{url}/generate_stream", json={"inputs": "x", "parameters": {"grammar": grammar}})
    assert stream.status_code == 200 and "grammar is not supported" in stream.text
    field = {"guided_json": {"type": "object"}} if kind == "json_schema" else {"guided_regex": "a+"}
    for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "x"})):
        r = httpx.post(url + path, json={"model": "m-trt", **body, **field}, timeout=TIMEOUT)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == next(iter(field))
        assert f"a {kind} constraint, which backend 'trt' (triton) of model 'm-trt'" in error["message"]
    if kind == "json_schema":
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": "m-trt", "messages": ASK, "tools": [WEATHER],
                                                                "tool_choice": choice}, timeout=TIMEOUT)
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
            assert "backend 'trt' (triton)" in r.json()["error"]["message"]
    assert len(triton.requests) == sent  # nothing reached the upstream


def test_native_tools_pass_through_and_come_back(remote: tuple[str, ScriptedUpstream, ScriptedUpstream]) -> None:
    url, _, vllm = remote
    client = OpenAI(base_url=f"{url}/v1", api_key="x", timeout=TIMEOUT, max_retries=0)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}, {"role": "user", "content": "And Paris?"}]
    resp = client.chat.completions.create(model="m-vllm", messages=history, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=50)
    sent = vllm.sent("/v1/chat/completions")[-1]
    assert sent["tools"] == [WEATHER] and sent["tool_choice"] == "required" and sent["parallel_tool_calls"] is False
    assert sent["messages"][1]["tool_calls"][0]["id"] == "call_1" and sent["messages"][2]["tool_call_id"] == "call_1"
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [("chatcmpl-tool-abc", "get_weather", '{"city": "Paris"}')]
    raw = httpx.post(f"{url}/v1/chat/completions", timeout=TIMEOUT, json={
        "model": "m-vllm", "messages": ASK, "tools": [WEATHER], "stream": True,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}).text
    chunks = [json.loads(p[6:]) for p in raw.split("\n\n") if p.startswith("data: {")]
    pieces = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", [])]
    assert pieces[0] == {"index": 0, "id": "chatcmpl-tool-abc", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"  # a named tool: vLLM's `stop`

