"""Remote backends against recorded upstreams (TGI, Triton in both namings, trtllm-serve), through a
real gateway process: both doors, streaming and not, the requests they send, and every failure."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from engine_core import LLMEngine, SamplingParams
from tests.recordings import (
    FAILURES,
    TEXT,
    tgi_routes,
    triton_ensemble_routes,
    triton_llmapi_routes,
    trtllm_routes,
    vllm_held_back_routes,
)
from tests.server import CLIENT_TIMEOUT, START_TIMEOUT, WAIT, running_gateway, wait_until
from tests.upstream import Recorded, ScriptedUpstream, scripted_upstream

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\\n{% endfor %}assistant:"
REMOTE = {"tgi": ("tgi", tgi_routes, ""), "triton": ("triton", triton_ensemble_routes, 'dialect = "ensemble"\n'),
          "llmapi": ("triton", triton_llmapi_routes, 'model = "tensorrt_llm"\ndialect = "llmapi"\n'),
          "trtllm": ("openai", trtllm_routes, 'model = "llama"\nflavor = "trtllm"\napi_key_env = "TRT_KEY"\n'),
          "vllm": ("openai", vllm_held_back_routes, 'model = "llama"\n')}
FAILURE_TYPES = {"tgi": "tgi", "triton": "triton", "trtllm": "openai", "vllm": "openai", "hang": "openai",
                 "slow": "openai"}


def backend_table(name: str, kind: str, url: str, extra: str, first_token_timeout: float = 2.0,
                  idle_timeout: float = 1.0) -> str:
    template = f'chat_template = "{TEMPLATE}"\n' if kind == "triton" else ""
    return (f'[backends.{name}]\ntype = "{kind}"\nbase_url = "{url}"\n{extra}{template}'
            f"first_token_timeout = {first_token_timeout}\nidle_timeout = {idle_timeout}\n\n"
            f'[models.m-{name}]\nbackend = "{name}"\n\n')


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Iterator[tuple[str, dict]]:
    """One gateway with the engine, the four recorded upstreams and every failure upstream."""
    with ExitStack() as stack:
        upstreams: dict[str, ScriptedUpstream] = {}
        config = ('default_model = "m-engine"\n\n[backends.engine]\ntype = "engine"\ndtype = "float32"\n'
                  'kv_cache_mb = 128\n\n[models.m-engine]\nbackend = "engine"\n\n')
        for name, (kind, routes, extra) in REMOTE.items():
            upstreams[name] = stack.enter_context(scripted_upstream(routes()))
            config += backend_table(name, kind, upstreams[name].url, extra, first_token_timeout=WAIT,
                                    idle_timeout=WAIT)  # answering at once: no timeout to outlast
        for name, routes in FAILURES.items():
            upstreams[name] = stack.enter_context(scripted_upstream(routes))
            kind = FAILURE_TYPES[name.split("_")[0]]
            config += backend_table(name, kind, upstreams[name].url, 'model = "llama"\n' if kind == "openai" else "")
        # the hang again, where neither gateway timeout can end it first: only a client that leaves does
        upstreams["patient"] = stack.enter_context(scripted_upstream(FAILURES["hang"]))
        config += backend_table("patient", "openai", upstreams["patient"].url, 'model = "llama"\n',
                                first_token_timeout=WAIT, idle_timeout=WAIT)
        url = stack.enter_context(running_gateway(config, tmp_path_factory.mktemp("remote"), wait_healthy=False,
                                                  env={"TRT_KEY": "sk-upstream-secret"}))

        def engine_answers() -> bool:  # the engine loads in the background; the recorded upstreams are up already
            body = {"inputs": "x", "parameters": {"max_new_tokens": 1}}
            return httpx.post(f"{url}/generate", json=body, timeout=CLIENT_TIMEOUT).status_code == 200

        wait_until(engine_answers, "the engine answers", timeout=START_TIMEOUT, interval=0.2)
        yield url, upstreams


def engine_chat(engine: LLMEngine, text: str, n: int) -> str:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)
    [out] = engine.generate([engine.tokenizer.encode(rendered, add_special_tokens=False)],
                            SamplingParams(max_new_tokens=n))
    return "".join(o.text for o in out)


def tgi_door(url: str, model: str, stream: bool) -> str:
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 16}}
    if not stream:
        r = httpx.post(f"{url}/models/{model}/generate", json=body, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()["generated_text"]
    raw = httpx.post(f"{url}/models/{model}/generate_stream", json=body, timeout=CLIENT_TIMEOUT).text
    events = [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: ")]
    assert [e["index"] for e in events] == list(range(1, len(events) + 1)) and "error" not in events[-1]
    return events[-1]["generated_text"]


def openai_door(url: str, model: str, stream: bool) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "temperature": 0,
            "stream": stream}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    payloads = [p[6:] for p in r.text.split("\n\n") if p.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return "".join(json.loads(p)["choices"][0]["delta"]["content"] or "" for p in payloads[:-1])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("door", ["tgi", "openai"])
@pytest.mark.parametrize("backend", ["engine", "trtllm", "tgi", "triton", "llmapi"])
def test_matrix_every_door_reaches_every_backend(remote: tuple[str, dict], engine_fp32: LLMEngine, door: str,
                                                 backend: str, stream: bool) -> None:
    url, _ = remote
    if backend == "engine":
        if door == "tgi":
            [out] = engine_fp32.generate(["Hi"], SamplingParams(max_new_tokens=16))
            expected = "".join(o.text for o in out)
        else:
            expected = engine_chat(engine_fp32, "Hi", 16)
    else:
        expected = TEXT
    call = tgi_door if door == "tgi" else openai_door
    assert call(url, f"m-{backend}", stream) == expected


def test_tgi_upstream_gets_only_what_tgi_accepts(remote: tuple[str, dict]) -> None:
    url, upstreams = remote
    httpx.post(f"{url}/v1/completions", json={"model": "m-tgi", "prompt": "Hi", "temperature": 0, "top_p": 1.0,
                                              "max_tokens": 5, "stop": "x"}, timeout=CLIENT_TIMEOUT)
    sent = upstreams["tgi"].sent("/generate_stream")[-1]
    assert sent["inputs"] == "Hi" and sent["parameters"]["do_sample"] is False
    for key in ("temperature", "top_p", "top_k", "typical_p"):
        assert key not in sent["parameters"]
    assert sent["parameters"]["stop"] == ["x"] and sent["parameters"]["max_new_tokens"] == 5
    httpx.post(f"{url}/models/m-tgi/generate", json={"inputs": "Hi", "parameters": {
        "do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9}}, timeout=CLIENT_TIMEOUT)
    sampled = upstreams["tgi"].sent("/generate_stream")[-1]["parameters"]
    assert (sampled["temperature"], sampled["top_k"], sampled["top_p"], sampled["do_sample"]) == (0.7, 5, 0.9, True)


def test_triton_upstream_never_gets_null_and_gets_its_dialect(remote: tuple[str, dict]) -> None:
    url, upstreams = remote

    def nulls(value: object) -> bool:
        return value is None or (isinstance(value, dict) and any(nulls(v) for v in value.values())) or \
            (isinstance(value, list) and any(nulls(v) for v in value))

    tgi_door(url, "m-triton", False)
    ensemble = upstreams["triton"].sent("/v2/models/ensemble/generate_stream")[-1]
    assert not nulls(ensemble) and ensemble["text_input"] == "Hi" and ensemble["max_tokens"] == 16
    assert ensemble["stream"] is True and ensemble["top_k"] == 1  # greedy in TensorRT-LLM terms
    openai_door(url, "m-llmapi", False)
    llmapi = upstreams["llmapi"].sent("/v2/models/tensorrt_llm/generate_stream")[-1]
    assert not nulls(llmapi) and llmapi["text_input"] == "user: Hi\nassistant:"  # the configured template
    assert llmapi["sampling_param_max_tokens"] == 16 and llmapi["streaming"] is True


TRTLLM_FIELDS = {"model", "messages", "prompt", "max_tokens", "temperature", "top_p", "stream", "stream_options",
                 "stop", "seed", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "top_k",
                 "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids"}


def test_trtllm_upstream_gets_no_unknown_fields(remote: tuple[str, dict]) -> None:
    url, upstreams = remote
    httpx.post(f"{url}/v1/chat/completions", json={"model": "m-trtllm", "user": "u1", "top_k": 3, "seed": 1,
                                                   "messages": [{"role": "user", "content": "Hi"}]},
               timeout=CLIENT_TIMEOUT)
    sent = upstreams["trtllm"].sent("/v1/chat/completions")[-1]
    assert set(sent) <= TRTLLM_FIELDS and sent["model"] == "llama" and sent["top_k"] == 3
    # trtllm-serve refuses stream_options without stream: a whole answer is asked for without it
    assert sent["stream"] is False and "stream_options" not in sent
    assert sent["messages"] == [{"role": "user", "content": "Hi"}]  # chat passes through as messages
    assert all(v is not None for v in sent.values())
    httpx.post(f"{url}/v1/chat/completions", json={"model": "m-trtllm", "stream": True,
                                                   "messages": [{"role": "user", "content": "Hi"}]},
               timeout=CLIENT_TIMEOUT)
    streamed = upstreams["trtllm"].sent("/v1/chat/completions")[-1]
    assert set(streamed) <= TRTLLM_FIELDS
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}


def test_usage_and_finish_come_from_the_upstream(remote: tuple[str, dict]) -> None:
    url, _ = remote
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "m-trtllm", "messages": [
        {"role": "user", "content": "Hi"}]}, timeout=CLIENT_TIMEOUT).json()
    assert chat["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert chat["choices"][0]["finish_reason"] == "stop"
    details = httpx.post(f"{url}/models/m-tgi/generate", json={"inputs": "Hi", "parameters": {
        "details": True}}, timeout=CLIENT_TIMEOUT).json()["details"]
    assert details["finish_reason"] == "length" and [t["id"] for t in details["tokens"]] == [9, 10, 11]
    llm = httpx.post(f"{url}/models/m-llmapi/generate", json={"inputs": "Hi", "parameters": {"details": True}},
                     timeout=CLIENT_TIMEOUT).json()
    assert llm["details"]["finish_reason"] == "length"  # the LLM-API model reports it


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_streamed_usage_is_the_upstreams_count_not_the_number_of_chunks(remote: tuple[str, dict], path: str) -> None:
    """vLLM sends text it held back (a possible stop string, a split multi-byte character) as one chunk of
    several tokens: the usage chunk passes on the upstream's count."""
    url, _ = remote
    body = {"model": "m-vllm", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 3}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    raw = httpx.post(f"{url}{path}", json=body, timeout=CLIENT_TIMEOUT).text
    chunks = [json.loads(p[6:]) for p in raw.split("\n\n") if p.startswith("data: ") and p != "data: [DONE]"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_api_key_comes_from_the_environment_and_the_clients_own_is_not_forwarded(remote: tuple[str, dict]) -> None:
    url, upstreams = remote
    httpx.post(f"{url}/v1/chat/completions", headers={"authorization": "Bearer client-key"},
               json={"model": "m-trtllm", "messages": [{"role": "user", "content": "Hi"}]}, timeout=CLIENT_TIMEOUT)
    assert upstreams["trtllm"].requests[-1].headers["authorization"] == "Bearer sk-upstream-secret"
    httpx.post(f"{url}/models/m-tgi/generate", headers={"authorization": "Bearer client-key"}, json={"inputs": "Hi"},
               timeout=CLIENT_TIMEOUT)
    assert "authorization" not in upstreams["tgi"].requests[-1].headers


def test_traceparent_is_forwarded_upstream(remote: tuple[str, dict]) -> None:
    url, upstreams = remote
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    httpx.post(f"{url}/models/m-tgi/generate", json={"inputs": "Hi"}, headers={"traceparent": trace},
               timeout=CLIENT_TIMEOUT)
    assert upstreams["tgi"].requests[-1].headers["traceparent"] == trace


FAILURE_CASES = [
    # name, model route, door, stream, expected status, what the error says
    ("tgi_overloaded", "tgi", False, 429, "Model is overloaded"),
    ("tgi_overloaded", "openai", False, 429, "overloaded"),
    ("tgi_plain_text_422", "tgi", False, 422, "Input validation error: Failed to deserialize"),
    ("trtllm_flat_400", "openai", False, 400, "max_tokens is too large"),
    ("trtllm_flat_400", "tgi", False, 422, "Input validation error: max_tokens is too large"),
    ("vllm_nested_404", "openai", False, 502, "does not exist"),
    ("tgi_error_event", "tgi", False, 424, "CUDA out of memory"),
    ("triton_error_in_200", "openai", False, 502, "in-flight batcher failed"),
    ("trtllm_cut", "openai", False, 502, "answer broken"),
    ("hang", "tgi", False, 504, "first-token timeout"),
    ("slow_first_token", "openai", False, 504, "first-token timeout"),
]


@pytest.mark.parametrize(("name", "door", "stream", "status", "needle"), FAILURE_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in FAILURE_CASES])
def test_upstream_failures_become_the_doors_own_errors(remote: tuple[str, dict], name: str, door: str, stream: bool,
                                                       status: int, needle: str) -> None:
    url, _ = remote
    if door == "tgi":
        r = httpx.post(f"{url}/models/m-{name}/generate", json={"inputs": "Hi"}, timeout=CLIENT_TIMEOUT)
        assert set(r.json()) == {"error", "error_type"}
        message = r.json()["error"]
    else:
        body = {"model": f"m-{name}", "messages": [{"role": "user", "content": "Hi"}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        message = r.json()["error"]["message"]
    assert r.status_code == status and needle in message, r.text


@pytest.mark.parametrize(("name", "door", "needle"), [
    ("tgi_error_event", "tgi", "CUDA out of memory"), ("hang", "openai", "idle timeout"),
    ("trtllm_cut", "tgi", "stream broken"), ("trtllm_truncated", "tgi", "Incomplete generation stream")])
def test_errors_after_the_first_token_end_the_stream_with_an_error_event(remote: tuple[str, dict], name: str,
                                                                         door: str, needle: str) -> None:
    url, _ = remote
    if door == "tgi":
        raw = httpx.post(f"{url}/models/m-{name}/generate_stream", json={"inputs": "Hi"}, timeout=CLIENT_TIMEOUT).text
        events = [json.loads(p[6:]) for p in raw.split("\n\n") if p.startswith("data: ")]
        assert set(events[-1]) == {"error", "error_type"} and all("token" in e for e in events[:-1])
        assert needle in events[-1]["error"] and len(events) >= 2
    else:
        raw = httpx.post(f"{url}/v1/chat/completions", timeout=CLIENT_TIMEOUT, json={
            "model": f"m-{name}", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}).text
        payloads = [p[6:] for p in raw.split("\n\n") if p.startswith("data: ")]
        error = json.loads(payloads[-2])["error"]
        assert payloads[-1] == "[DONE]" and set(error) == {"message", "type", "param", "code"}
        assert needle in error["message"]


def last_chat(upstream: ScriptedUpstream) -> Recorded:
    return [q for q in upstream.requests if q.path == "/v1/chat/completions"][-1]


def test_client_going_away_closes_the_upstream_request(remote: tuple[str, dict]) -> None:
    """By order, not by the clock: the backend's timeouts are far out of reach, and the upstream would
    go on for 30 s; the upstream request is closed because the client left."""
    url, upstreams = remote
    hang: ScriptedUpstream = upstreams["patient"]
    before = hang.broken_writes
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=CLIENT_TIMEOUT, json={
            "model": "m-patient", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one event, then hang up
    # the gateway drops its upstream connection: the upstream sees it at its next keep-alive
    wait_until(lambda: hang.broken_writes > before or last_chat(hang).answered, "the upstream request closed")
    assert hang.broken_writes == before + 1


def test_client_going_away_cancels_a_non_streaming_request_upstream(remote: tuple[str, dict]) -> None:
    url, upstreams = remote
    hang: ScriptedUpstream = upstreams["patient"]
    before = hang.broken_writes
    with pytest.raises(httpx.ReadTimeout):  # the client waits 0.3 s for the answer, then hangs up
        httpx.post(f"{url}/v1/chat/completions", timeout=httpx.Timeout(CLIENT_TIMEOUT, read=0.3),
                   json={"model": "m-patient", "messages": [{"role": "user", "content": "Hi"}]})
    wait_until(lambda: hang.broken_writes > before or last_chat(hang).answered, "the upstream request closed")
    assert hang.broken_writes == before + 1
