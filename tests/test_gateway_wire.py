"""The wire, byte for byte: SSE framing, spec conformance, info routes, and the bad-input table."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.server import CLIENT_TIMEOUT
from tests.spec import REFERENCE, specs_available, validate


def test_reference_specs_are_present() -> None:
    if not specs_available():
        pytest.skip(f"reference specs not found at {REFERENCE}: responses are not validated against them here")


def sse_payloads(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    frames = raw[:-2].split(b"\n\n")
    for frame in frames:
        assert frame.startswith(b"data: ") and b"\n" not in frame, frame
    return [f[len(b"data: "):] for f in frames]


def test_tgi_stream_framing_is_exact(gateway_url: str) -> None:
    with httpx.stream("POST", f"{gateway_url}/generate_stream", json={
            "inputs": "The capital of France is", "parameters": {"max_new_tokens": 5, "details": True,
                                                                 "top_n_tokens": 2}}, timeout=CLIENT_TIMEOUT) as r:
        raw = r.read()
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no" and r.headers["cache-control"] == "no-cache"
        # TGI's streaming subset of its timing headers only
        assert r.headers["x-compute-type"] and r.headers["x-compute-characters"] == str(len("The capital of France is"))
        assert "x-total-time" not in r.headers and "x-generated-tokens" not in r.headers
    payloads = sse_payloads(raw)
    assert b"[DONE]" not in raw and len(payloads) == 5
    events = [json.loads(p) for p in payloads]
    assert [e["index"] for e in events] == [1, 2, 3, 4, 5]
    for e in events[:-1]:
        assert list(e) == ["index", "token", "top_tokens", "generated_text", "details"]
        assert e["generated_text"] is None and e["details"] is None and len(e["top_tokens"]) == 2
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 5, "seed": None, "input_length": 5}
    for e in events:
        validate("tgi", "StreamResponse", e)
    # compact JSON, as serde writes it
    assert payloads[0] == json.dumps(events[0], separators=(",", ":"), ensure_ascii=False).encode()


def test_tgi_stream_leaves_out_top_tokens_and_details_when_not_asked(gateway_url: str) -> None:
    raw = httpx.post(f"{gateway_url}/generate_stream",
                     json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, timeout=CLIENT_TIMEOUT).content
    events = [json.loads(p) for p in sse_payloads(raw)]
    assert "top_tokens" not in events[0] and events[-1]["details"] is None
    assert events[-1]["generated_text"] is not None


def test_tgi_stream_validation_error_is_an_event_with_status_200(gateway_url: str) -> None:
    r = httpx.post(f"{gateway_url}/generate_stream", json={"inputs": "x", "parameters": {"top_p": 1.0}},
                   timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200
    assert r.content == b'data: {"error":"Input validation error: `top_p` must be > 0.0 and < 1.0",' \
                        b'"error_type":"validation"}\n\n'


def test_openai_stream_framing_ends_with_done(gateway_url: str) -> None:
    raw = httpx.post(f"{gateway_url}/v1/chat/completions", json={
        "model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}}, timeout=CLIENT_TIMEOUT).content
    payloads = sse_payloads(raw)
    assert payloads[-1] == b"[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    for c in chunks:
        validate("openai", "CreateChatCompletionStreamResponse", c)
        assert c["object"] == "chat.completion.chunk"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])
    assert all(c["choices"][0]["delta"]["role"] == "assistant" for c in chunks[:-1])


def test_openai_stream_without_usage_leaves_the_field_out(gateway_url: str) -> None:
    raw = httpx.post(f"{gateway_url}/v1/chat/completions", json={
        "model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True},
        timeout=CLIENT_TIMEOUT).content
    chunks = [json.loads(p) for p in sse_payloads(raw)[:-1]]
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] is not None


def test_generate_response_matches_tgi_spec_and_headers(gateway_url: str) -> None:
    r = httpx.post(f"{gateway_url}/generate", json={"inputs": "Hello there", "parameters": {
        "max_new_tokens": 4, "decoder_input_details": True, "top_n_tokens": 3, "do_sample": True, "seed": 3}},
        timeout=CLIENT_TIMEOUT)
    body = r.json()
    validate("tgi", "GenerateResponse", body)
    assert body["details"]["seed"] == 3 and len(body["details"]["prefill"]) == int(r.headers["x-prompt-tokens"])
    assert r.headers["x-generated-tokens"] == "4" and float(r.headers["x-compute-time"]) > 0
    assert int(r.headers["x-total-time"]) >= int(r.headers["x-inference-time"])
    assert r.headers["x-compute-characters"] == str(len("Hello there"))
    plain = httpx.post(f"{gateway_url}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}},
                       timeout=CLIENT_TIMEOUT)
    assert list(plain.json()) == ["generated_text"]  # no details key at all


def test_chat_response_matches_openai_spec(gateway_url: str) -> None:
    body = httpx.post(f"{gateway_url}/v1/chat/completions", json={
        "model": "smollm2", "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_tokens": 4, "logprobs": True, "top_logprobs": 1}, timeout=CLIENT_TIMEOUT).json()
    validate("openai", "CreateChatCompletionResponse", body)


def test_info_health_tokenize_and_models(gateway_url: str) -> None:
    info = httpx.get(f"{gateway_url}/info", timeout=CLIENT_TIMEOUT).json()
    validate("tgi", "Info", info)
    assert info["model_id"] == "smollm2" and info["max_input_tokens"] == 1024 and info["max_total_tokens"] == 2048
    health = httpx.get(f"{gateway_url}/health", timeout=CLIENT_TIMEOUT)
    assert health.status_code == 200 and health.content == b""
    tokens = httpx.post(f"{gateway_url}/tokenize", json={"inputs": "héllo world"}, timeout=CLIENT_TIMEOUT).json()
    validate("tgi", "TokenizeResponse", tokens)
    raw = "héllo world".encode()
    assert b"".join(raw[t["start"]:t["stop"]] for t in tokens) == raw  # byte offsets that tile the input
    models = httpx.get(f"{gateway_url}/v1/models", timeout=CLIENT_TIMEOUT).json()
    assert models == {"object": "list", "data": [{"id": "smollm2", "object": "model", "created": 0,
                                                  "owned_by": "llm-gateway"}]}


TGI_BAD = [
    ("/generate", b"{not json", 400, "Failed to parse the request body as JSON"),
    ("/generate", b'{"inputs": 5}', 422, "inputs"),
    ("/generate", b'{"parameters": {}}', 422, "inputs"),
    ("/generate", b'[1, 2]', 422, "Expected `object`"),
    ("/generate", b'{"inputs": ""}', 422, "`inputs` cannot be empty"),
    ("/generate", b'{"inputs": "x", "parameters": {"temperature": 0}}', 422, "`temperature` must be strictly positive"),
    ("/generate", b'{"inputs": "x", "parameters": {"top_k": 0}}', 422, "`top_k` must be strictly positive"),
    ("/generate", b'{"inputs": "x", "parameters": {"typical_p": 1.5}}', 422, "`typical_p` must be > 0.0 and < 1.0"),
    ("/generate", b'{"inputs": "x", "parameters": {"max_new_tokens": 0}}', 422, "`max_new_tokens` must be strictly"),
    ("/generate", b'{"inputs": "x", "parameters": {"max_new_tokens": 100000}}', 422, "`max_new_tokens` must be <="),
    ("/generate", b'{"inputs": "x", "parameters": {"max_new_tokens": "many"}}', 422, "parameters.max_new_tokens"),
    ("/generate", b'{"inputs": "x", "parameters": {"repetition_penalty": -1}}', 422, "`repetition_penalty`"),
    ("/generate", b'{"inputs": "x", "parameters": {"frequency_penalty": 3}}', 422, "`frequency_penalty` must be"),
    ("/generate", b'{"inputs": "x", "parameters": {"stop": ["a","b","c","d","e"]}}', 422, "up to 4 stop sequences"),
    ("/generate", b'{"inputs": "x", "parameters": {"top_n_tokens": 9}}', 422, "`top_n_tokens` must be >= 0 and <= 5"),
    ("/generate", b'{"inputs": "x", "parameters": {"best_of": 2}}', 422, "you must use sampling when `best_of`"),
    ("/generate", b'{"inputs": "x", "parameters": {"best_of": 9, "do_sample": true}}', 422, "`best_of` must be > 0"),
    ("/generate", b'{"inputs": "x", "parameters": {"truncate": 0}}', 422, "`truncate` must be strictly positive"),
    ("/generate", b'{"inputs": "x", "parameters": {"grammar": {"type": "json", "value": {}}}}', 422,
     "grammar is not valid: Grammar must have a 'properties' field"),
    ("/generate", ("{\"inputs\": \"" + "word " * 1100 + "\"}").encode(), 422, "`inputs` must have less than 1024"),
    ("/generate", ("{\"inputs\": \"" + "word " * 1000 + "\", \"parameters\": {\"max_new_tokens\": 1100}}").encode(),
     422, "`inputs` tokens + `max_new_tokens` must be <= 2048"),
    ("/", b'{"inputs": 1}', 422, "inputs"),
    ("/tokenize", b'{"inputs": ""}', 422, "`inputs` cannot be empty"),
    ("/models/smollm2/generate", b'{"inputs": "x", "parameters": {"seed": -5}}', 422, "parameters.seed"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), TGI_BAD, ids=[f"{p} {n}"[:60] for p, _, _, n in TGI_BAD])
def test_tgi_bad_input_gets_tgi_errors(gateway_url: str, path: str, body: bytes, status: int, needle: str) -> None:
    r = httpx.post(gateway_url + path, content=body, headers={"content-type": "application/json"},
                   timeout=CLIENT_TIMEOUT)
    assert r.status_code == status, r.text
    payload = r.json()
    assert set(payload) == {"error", "error_type"} and needle in payload["error"]
    assert "Traceback" not in r.text
    validate("tgi", "ErrorResponse", payload)


CHAT = '"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]'
OPENAI_BAD = [
    ("/v1/chat/completions", b"{oops", 400, None, "Failed to parse the request body as JSON"),
    ("/v1/chat/completions", b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model",
     "does not exist"),
    ("/v1/chat/completions", b'{"model": "smollm2"}', 400, None, "messages"),
    ("/v1/chat/completions", b'{"model": "smollm2", "messages": []}', 400, "messages", "length >= 1"),
    ("/v1/chat/completions", b'{"model": "smollm2", "messages": [{"role": "robot", "content": "x"}]}', 400,
     "messages[0].role", "Invalid enum value"),
    ("/v1/chat/completions", f'{{{CHAT}, "temperature": 3}}'.encode(), 400, "temperature", "<= 2.0"),
    ("/v1/chat/completions", f'{{{CHAT}, "top_p": 0}}'.encode(), 400, "top_p", "> 0.0"),
    ("/v1/chat/completions", f'{{{CHAT}, "max_tokens": 0}}'.encode(), 400, "max_tokens", ">= 1"),
    ("/v1/chat/completions", f'{{{CHAT}, "max_tokens": 99999}}'.encode(), 400, "max_tokens", "must be <="),
    ("/v1/chat/completions", f'{{{CHAT}, "n": 1000}}'.encode(), 400, "n", "`n` must be <="),
    ("/v1/chat/completions", f'{{{CHAT}, "presence_penalty": -3}}'.encode(), 400, "presence_penalty", ">= -2.0"),
    ("/v1/chat/completions", f'{{{CHAT}, "stop": 5}}'.encode(), 400, "stop", "Expected"),
    ("/v1/chat/completions", f'{{{CHAT}, "stop": ["a","b","c","d","e"]}}'.encode(), 400, "stop", "up to 4"),
    ("/v1/chat/completions", f'{{{CHAT}, "top_logprobs": 50, "logprobs": true}}'.encode(), 400, "top_logprobs",
     "<= 20"),
    ("/v1/chat/completions", f'{{{CHAT}, "tools": [{{"type": "custom", "custom": {{"name": "f"}}}}]}}'.encode(),
     400, "tools[0].type", "not supported"),
    ("/v1/chat/completions", f'{{{CHAT}, "response_format": {{"type": "json_schema", "json_schema": '
     f'{{"name": "x"}}}}}}'.encode(), 400, "response_format.json_schema.schema", "must be set"),
    ("/v1/chat/completions", b'{"model": "smollm2", "messages": [{"role": "user", "content": [{"type": "image_url",'
     b' "image_url": {"url": "http://x"}}]}]}', 400, "messages[0].content[0]", "not supported"),
    ("/v1/chat/completions", f'{{{CHAT}, "logit_bias": {{"5": 10}}}}'.encode(), 400, "logit_bias", "not supported"),
    ("/v1/chat/completions", ('{"model": "smollm2", "messages": [{"role": "user", "content": "'
                              + "word " * 1100 + '"}]}').encode(), 400, "messages", "maximum input length"),
    ("/v1/completions", b'{"model": "smollm2", "prompt": ""}', 400, "prompt", "must not be empty"),
    ("/v1/completions", b'{"model": "smollm2", "prompt": [1, "a"]}', 400, "prompt", "must be a string"),
    ("/v1/completions", b'{"model": "smollm2", "prompt": "x", "suffix": "y"}', 400, "suffix", "not supported"),
    ("/v1/completions", b'{"model": "smollm2", "prompt": "x", "logprobs": 99}', 400, "logprobs", "<= 20"),
    ("/v1/completions", b'{"model": "smollm2", "prompt": [99999999]}', 400, None, "token ids must be in"),
    ("/v1/completions", b'{"model": "smollm2"}', 400, None, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "needle"), OPENAI_BAD,
                         ids=[f"{p} {n}"[:60] for p, _, _, _, n in OPENAI_BAD])
def test_openai_bad_input_gets_openai_errors(gateway_url: str, path: str, body: bytes, status: int,
                                             param: str | None, needle: str) -> None:
    r = httpx.post(gateway_url + path, content=body, headers={"content-type": "application/json"},
                   timeout=CLIENT_TIMEOUT)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and needle in error["message"], error
    assert error["param"] == param
    validate("openai", "ErrorResponse", r.json())


def test_unknown_route_and_wrong_method_keep_the_protocol_shape(gateway_url: str) -> None:
    tgi = httpx.get(f"{gateway_url}/generate", timeout=CLIENT_TIMEOUT)
    assert tgi.status_code == 405 and set(tgi.json()) == {"error", "error_type"}
    oai = httpx.get(f"{gateway_url}/v1/nothing", timeout=CLIENT_TIMEOUT)
    assert oai.status_code == 404 and set(oai.json()["error"]) == {"message", "type", "param", "code"}


def test_oversized_body_is_refused_with_413(gateway_url: str) -> None:
    r = httpx.post(f"{gateway_url}/generate", content=b'{"inputs": "' + b"x" * 2_100_000 + b'"}',
                   headers={"content-type": "application/json"}, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 413 and set(r.json()) == {"error", "error_type"}


def test_spec_validation_catches_a_wrong_shape() -> None:
    if not specs_available():
        pytest.skip(f"reference specs not found at {REFERENCE}")
    with pytest.raises(jsonschema.ValidationError):
        validate("tgi", "GenerateResponse", {"details": None})
    with pytest.raises(jsonschema.ValidationError):
        validate("openai", "ErrorResponse", {"error": {"message": "m"}})
