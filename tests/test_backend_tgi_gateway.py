"""The `tgi` backend against a real TGI-protocol server: a second gateway process serving the
embedded model through its TGI routes."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from engine_core import LLMEngine, SamplingParams
from tests.server import CLIENT_TIMEOUT, running_gateway


@pytest.fixture(scope="module")
def front(gateway_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = f"""
default_model = "relayed"

[backends.upstream-tgi]
type = "tgi"
base_url = "{gateway_url}"

[models.relayed]
backend = "upstream-tgi"
"""
    with running_gateway(config, tmp_path_factory.mktemp("front")) as url:
        yield url


def engine_text(engine: LLMEngine, prompt: str | list[int], n: int, **kw) -> str:
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=n, **kw))
    return "".join(o.text for o in out)


def test_greedy_through_a_tgi_upstream_equals_the_engine(front: str, engine_fp32: LLMEngine) -> None:
    prompt = "The capital of France is"
    expected = engine_text(engine_fp32, prompt, 12)
    body = httpx.post(f"{front}/generate", json={"inputs": prompt, "parameters": {
        "max_new_tokens": 12, "details": True}}, timeout=CLIENT_TIMEOUT).json()
    assert body["generated_text"] == expected
    assert body["details"]["generated_tokens"] == 12 and body["details"]["finish_reason"] == "length"
    [direct] = engine_fp32.generate([prompt], SamplingParams(max_new_tokens=12))
    assert [t["id"] for t in body["details"]["tokens"]] == [o.token_id for o in direct]
    raw = httpx.post(f"{front}/generate_stream", json={"inputs": prompt, "parameters": {"max_new_tokens": 12}},
                     timeout=CLIENT_TIMEOUT).text
    assert f'"generated_text":{httpx.Response(200, json=expected).text}' in raw


def test_openai_door_through_a_tgi_upstream(front: str, engine_fp32: LLMEngine) -> None:
    prompt = "Once upon a time"
    completion = httpx.post(f"{front}/v1/completions", json={"model": "relayed", "prompt": prompt, "max_tokens": 10,
                                                             "temperature": 0}, timeout=CLIENT_TIMEOUT).json()
    assert completion["choices"][0]["text"] == engine_text(engine_fp32, prompt, 10)
    assert completion["usage"]["completion_tokens"] == 10
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = httpx.post(f"{front}/v1/chat/completions", json={"model": "relayed", "messages": question,
                                                            "max_tokens": 20, "temperature": 0},
                      timeout=CLIENT_TIMEOUT).json()
    rendered = engine_fp32.tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    ids = engine_fp32.tokenizer.encode(rendered, add_special_tokens=False)
    assert chat["choices"][0]["message"]["content"] == engine_text(engine_fp32, ids, 20)


def test_stop_sequence_through_a_tgi_upstream_is_cut_on_the_openai_door(front: str, engine_fp32: LLMEngine) -> None:
    prompt = "The capital of France is"
    full = engine_text(engine_fp32, prompt, 12)
    stop = full[4:7]
    out = httpx.post(f"{front}/v1/completions", json={"model": "relayed", "prompt": prompt, "max_tokens": 12,
                                                      "temperature": 0, "stop": [stop]}, timeout=CLIENT_TIMEOUT).json()
    assert out["choices"][0]["text"] == full[: full.index(stop)] and out["choices"][0]["finish_reason"] == "stop"
    tgi = httpx.post(f"{front}/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 12,
                                                                                 "stop": [stop]}},
                     timeout=CLIENT_TIMEOUT).json()
    assert tgi["generated_text"] == full[: full.index(stop)] + stop  # the TGI door keeps it, as TGI does


def test_sampling_parameters_pass_through_a_tgi_upstream(front: str) -> None:
    body = {"inputs": "Hello", "parameters": {"do_sample": True, "seed": 11, "top_k": 20, "top_p": 0.9,
                                              "max_new_tokens": 6, "details": True}}
    a = httpx.post(f"{front}/generate", json=body, timeout=CLIENT_TIMEOUT).json()
    b = httpx.post(f"{front}/generate", json=body, timeout=CLIENT_TIMEOUT).json()
    assert a == b and a["details"]["seed"] == 11


def test_upstream_validation_errors_reach_the_client(front: str) -> None:
    r = httpx.post(f"{front}/generate", json={"inputs": "x " * 5000}, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert "must have less than" in r.json()["error"]
