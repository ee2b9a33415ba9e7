"""End to end through real clients: the `openai` SDK and huggingface_hub's InferenceClient,
against a real gateway process serving the embedded SmolLM2."""

from __future__ import annotations

import httpx
import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI

from engine_core import LLMEngine, SamplingParams
from tests.server import CLIENT_TIMEOUT

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def openai_client(gateway_url: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", timeout=CLIENT_TIMEOUT)


def engine_greedy(engine: LLMEngine, prompt: str | list[int], n: int) -> str:
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=n))
    return "".join(o.text for o in out)


def chat_prompt(engine: LLMEngine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def test_openai_chat_greedy_equals_the_engine(openai_client: OpenAI, engine_fp32: LLMEngine) -> None:
    resp = openai_client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                                 temperature=0, max_tokens=30)
    expected = engine_greedy(engine_fp32, chat_prompt(engine_fp32, QUESTION), 30)
    choice = resp.choices[0]
    assert choice.message.content == expected and "Paris" in expected
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert resp.model == "smollm2" and resp.id.startswith("chatcmpl-")
    assert resp.usage.prompt_tokens == len(chat_prompt(engine_fp32, QUESTION))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_openai_chat_stream_with_usage(openai_client: OpenAI, engine_fp32: LLMEngine) -> None:
    stream = openai_client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=30, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == engine_greedy(engine_fp32, chat_prompt(engine_fp32, QUESTION), 30)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_openai_chat_length_logprobs_and_n(openai_client: OpenAI) -> None:
    resp = openai_client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Tell me a story."}], max_completion_tokens=5,
        n=2, seed=7, temperature=1.0, logprobs=True, top_logprobs=2)
    assert len(resp.choices) == 2 and {c.index for c in resp.choices} == {0, 1}
    for choice in resp.choices:
        assert choice.finish_reason == "length" and len(choice.logprobs.content) == 5
        for entry in choice.logprobs.content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert entry.bytes == list(entry.token.encode())
    assert resp.usage.completion_tokens == 10


def test_openai_completions_stream_and_not(openai_client: OpenAI, engine_fp32: LLMEngine) -> None:
    prompt = "Once upon a time"
    expected = engine_greedy(engine_fp32, prompt, 12)
    resp = openai_client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "length"
    chunks = list(openai_client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == 4
    echoed = openai_client.completions.create(model="smollm2", prompt=[prompt, "Hello"], max_tokens=3, echo=True,
                                              temperature=0, logprobs=1)
    assert echoed.choices[0].text.startswith(prompt) and echoed.choices[1].text.startswith("Hello")
    assert echoed.choices[0].logprobs.text_offset[0] == len(prompt)


def test_openai_stop_string_is_cut(openai_client: OpenAI, engine_fp32: LLMEngine) -> None:
    full = engine_greedy(engine_fp32, chat_prompt(engine_fp32, QUESTION), 30)
    resp = openai_client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                                 temperature=0, max_tokens=30, stop="Paris")
    assert resp.choices[0].message.content == full[: full.index("Paris")]
    assert resp.choices[0].finish_reason == "stop"


def test_inference_client_text_generation_with_details(gateway_url: str, engine_fp32: LLMEngine) -> None:
    client = InferenceClient(model=gateway_url, timeout=CLIENT_TIMEOUT)
    prompt = "The capital of France is"
    out = client.text_generation(prompt, max_new_tokens=10, details=True, decoder_input_details=True,
                                 top_n_tokens=2, return_full_text=False)
    expected = engine_greedy(engine_fp32, prompt, 10)
    assert out.generated_text == expected
    # the client posts to `/` with return_full_text=null: TGI then prepends the prompt (text-generation models)
    assert client.text_generation(prompt, max_new_tokens=10) == prompt + expected
    assert out.details.finish_reason == "length" and out.details.generated_tokens == 10
    assert len(out.details.tokens) == 10 and all(t.logprob <= 0 for t in out.details.tokens)
    assert len(out.details.prefill) == len(engine_fp32.tokenize(prompt)) and out.details.prefill[0].logprob is None
    assert len(out.details.top_tokens) == 10 and all(len(t) == 2 for t in out.details.top_tokens)


def test_inference_client_text_generation_stream(gateway_url: str, engine_fp32: LLMEngine) -> None:
    client = InferenceClient(model=gateway_url, timeout=CLIENT_TIMEOUT)
    prompt = "The capital of France is"
    events = list(client.text_generation(prompt, max_new_tokens=10, stream=True, details=True,
                                         return_full_text=False))
    assert [e.index for e in events] == list(range(1, 11))
    assert all(e.generated_text is None for e in events[:-1])
    assert events[-1].generated_text == engine_greedy(engine_fp32, prompt, 10)
    assert events[-1].details.finish_reason == "length" and events[-1].details.generated_tokens == 10
    assert "".join(e.token.text for e in events) == events[-1].generated_text


def test_inference_client_chat_completion(gateway_url: str, engine_fp32: LLMEngine) -> None:
    client = InferenceClient(base_url=gateway_url, timeout=CLIENT_TIMEOUT)
    out = client.chat_completion(messages=[{"role": "user", "content": QUESTION}], model="smollm2", max_tokens=30,
                                 temperature=0)
    assert out.choices[0].message.content == engine_greedy(engine_fp32, chat_prompt(engine_fp32, QUESTION), 30)
    streamed = client.chat_completion(messages=[{"role": "user", "content": QUESTION}], model="smollm2",
                                      max_tokens=30, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == out.choices[0].message.content


def test_tgi_compat_route_and_per_model_mount(gateway_url: str, engine_fp32: LLMEngine) -> None:
    prompt = "The capital of France is"
    expected = engine_greedy(engine_fp32, prompt, 6)
    listed = httpx.post(gateway_url + "/", json={"inputs": prompt, "parameters": {"max_new_tokens": 6}},
                        timeout=CLIENT_TIMEOUT).json()
    assert listed == [{"generated_text": prompt + expected}]  # POST / defaults to return_full_text
    mounted = httpx.post(f"{gateway_url}/models/SmolLM2-135M-Instruct/generate",
                         json={"inputs": prompt, "parameters": {"max_new_tokens": 6}}, timeout=CLIENT_TIMEOUT)
    assert mounted.json() == {"generated_text": expected}
    missing = httpx.post(f"{gateway_url}/models/nope/generate", json={"inputs": prompt}, timeout=CLIENT_TIMEOUT)
    assert missing.status_code == 404 and missing.json()["error_type"] == "model_not_found"


def test_stop_sequence_finish_keeps_tgi_text(gateway_url: str, engine_fp32: LLMEngine) -> None:
    prompt = "The capital of France is"
    full = engine_greedy(engine_fp32, prompt, 10)
    stop = full[3:6]
    body = httpx.post(f"{gateway_url}/generate", json={"inputs": prompt, "parameters": {
        "max_new_tokens": 10, "stop": [stop], "details": True}}, timeout=CLIENT_TIMEOUT).json()
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["generated_text"] == full[: full.index(stop)] + stop  # TGI keeps the stop sequence


def test_sampling_with_seed_is_repeatable(gateway_url: str) -> None:
    body = {"inputs": "Write a word:", "parameters": {"do_sample": True, "seed": 42, "max_new_tokens": 8,
                                                      "details": True, "temperature": 0.9}}
    a = httpx.post(f"{gateway_url}/generate", json=body, timeout=CLIENT_TIMEOUT).json()
    b = httpx.post(f"{gateway_url}/generate", json=body, timeout=CLIENT_TIMEOUT).json()
    assert a == b and a["details"]["seed"] == 42
    no_params = httpx.post(f"{gateway_url}/generate", json={"inputs": "Write a word:"}, timeout=CLIENT_TIMEOUT).json()
    assert isinstance(no_params["generated_text"], str)  # absent parameters: TGI's defaults (sampling)


def test_best_of_returns_the_best_and_the_others(gateway_url: str) -> None:
    body = {"inputs": "Hello", "parameters": {"best_of": 2, "do_sample": True, "max_new_tokens": 4, "details": True}}
    out = httpx.post(f"{gateway_url}/generate", json=body, timeout=CLIENT_TIMEOUT).json()
    best = sum(t["logprob"] for t in out["details"]["tokens"])
    [other] = out["details"]["best_of_sequences"]
    assert best >= sum(t["logprob"] for t in other["tokens"])
