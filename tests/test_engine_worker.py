"""The engine in a worker process of its own (`workers = "process"`), through a real gateway process:
the same greedy tokens as the in-process engine, aborts that free the worker's blocks, and a worker killed
mid-request whose requests end with the protocol's error while it is started again."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.base import BackendValidationError, GenerationRequest
from backends.engine import EngineSettings
from backends.engine_worker import EngineWorkerBackend, WorkerLoad
from engine_core import LLMEngine, SamplingParams
from tests.server import CLIENT_TIMEOUT, ENGINE_CONFIG, running_gateway, wait_until

QUESTION = "What is the capital of France?"
# short health checks, so /health follows the worker's state; a crash's failures do not keep it ejected long
WORKER_CONFIG = ENGINE_CONFIG.replace('type = "engine"\n', 'type = "engine"\nworkers = "process"\n') + """
[server]
health_check_interval = 0.2
eject_cooldown = 1.0
"""


@pytest.fixture(scope="module")
def worker_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_gateway(WORKER_CONFIG, tmp_path_factory.mktemp("worker-gateway")) as url:
        yield url


@pytest.fixture(autouse=True)
def nothing_held_after_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test through the gateway: the worker idle, and every KV block free again."""
    yield
    if "worker_gateway" in request.fixturenames:
        url = request.getfixturevalue("worker_gateway")
        wait_until(lambda: idle(metrics(url)), "the engine worker idle with every block free")


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text


def value(text: str, name: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("backend") == "local":
                return sample.value
    return None


def idle(text: str) -> bool:
    total = value(text, "llmgw_engine_kv_blocks_total")
    return bool(total) and value(text, "llmgw_engine_kv_blocks_used") == 0 and \
        value(text, "llmgw_engine_running_seqs") == 0 and value(text, "llmgw_engine_waiting_seqs") == 0


def idle_metrics(url: str) -> str | None:
    text = metrics(url)
    return text if idle(text) else None


def engine_greedy(engine: LLMEngine, prompt: str | list[int], n: int) -> str:
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=n))
    return "".join(o.text for o in out)


def sse_data(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: {"):
            yield json.loads(line[6:])


def test_the_worker_serves_the_same_greedy_tokens_as_the_in_process_engine(worker_gateway: str,
                                                                           engine_fp32: LLMEngine) -> None:
    prompt = "Once upon a time"
    expected = engine_greedy(engine_fp32, prompt, 16)
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    whole = httpx.post(f"{worker_gateway}/v1/completions", json=body, timeout=CLIENT_TIMEOUT).json()
    assert whole["choices"][0]["text"] == expected and whole["usage"]["completion_tokens"] == 16
    with httpx.stream("POST", f"{worker_gateway}/v1/completions", json=body | {"stream": True},
                      timeout=CLIENT_TIMEOUT) as r:
        streamed = "".join(c["choices"][0]["text"] for c in sse_data(r.iter_lines()) if c["choices"])
    assert streamed == expected

    rendered = engine_fp32.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                                         add_generation_prompt=True)
    chat_expected = engine_greedy(engine_fp32, engine_fp32.tokenizer.encode(rendered, add_special_tokens=False), 20)
    chat = httpx.post(f"{worker_gateway}/v1/chat/completions", timeout=CLIENT_TIMEOUT, json={
        "model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 20, "temperature": 0})
    assert chat.json()["choices"][0]["message"]["content"] == chat_expected and "Paris" in chat_expected

    tgi = httpx.post(f"{worker_gateway}/generate", timeout=CLIENT_TIMEOUT, json={
        "inputs": prompt, "parameters": {"max_new_tokens": 16, "details": True, "decoder_input_details": True}})
    assert tgi.status_code == 200 and tgi.json()["generated_text"] == expected
    details = tgi.json()["details"]
    assert details["finish_reason"] == "length" and len(details["tokens"]) == 16
    assert [t["id"] for t in details["prefill"]] == engine_fp32.tokenizer.encode(prompt)


def test_tokenize_info_and_dtype_come_through_the_worker(worker_gateway: str, engine_fp32: LLMEngine) -> None:
    tokens = httpx.post(f"{worker_gateway}/tokenize", json={"inputs": "Hello world"}, timeout=CLIENT_TIMEOUT).json()
    assert [t["id"] for t in tokens] == engine_fp32.tokenizer.encode("Hello world")
    assert tokens[1] == {"id": tokens[1]["id"], "text": " world", "start": 5, "stop": 11}
    info = httpx.get(f"{worker_gateway}/info", timeout=CLIENT_TIMEOUT).json()
    assert info["model_dtype"] == "float32" and "config" in info["dtype_reason"]


def test_a_client_leaving_a_stream_frees_the_workers_blocks_within_engine_steps(worker_gateway: str) -> None:
    asked = 1000
    before = wait_until(lambda: idle_metrics(worker_gateway), "the worker idle")
    body = {"prompt": "Once upon a time", "max_tokens": asked, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{worker_gateway}/v1/completions", json=body, timeout=CLIENT_TIMEOUT) as r:
        assert r.status_code == 200
        for _ in sse_data(r.iter_lines()):
            break  # one token, then hang up
    # wait for figures from after the request: until the worker's next report the gateway still holds its idle
    # figures from before it (CI once read them: 0 steps). The abort is counted by the front as it closes the
    # stream. A request that is never aborted, or never freed, fails the wait or the counts below.
    after = wait_until(lambda: aborted_and_idle(worker_gateway, before), "the request aborted, its blocks freed")
    steps = value(after, "llmgw_engine_step_seconds_count") - value(before, "llmgw_engine_step_seconds_count")
    assert 1 <= steps < asked // 2, steps  # aborted, not run to its end
    assert aborts(after) - aborts(before) == 1


def aborts(text: str) -> float:
    return value(text, "llmgw_abort_seconds_count") or 0


def aborted_and_idle(url: str, before: str) -> str | None:
    """The metrics once the worker reports itself idle after steps taken since `before`, the abort counted."""
    text, steps = idle_metrics(url), "llmgw_engine_step_seconds_count"
    if text is None or value(text, steps) == value(before, steps):
        return None
    return text if aborts(text) > aborts(before) else None


def test_a_killed_worker_fails_its_requests_with_the_protocols_error_and_comes_back(worker_gateway: str) -> None:
    url = worker_gateway
    pid = int(wait_until(lambda: value(metrics(url), "llmgw_engine_worker_pid"), "the worker's pid"))
    restarts_before = value(metrics(url), "llmgw_engine_worker_restarts_total") or 0
    long = {"max_new_tokens": 1500}
    results: dict[str, Any] = {}
    first_tokens = threading.Barrier(3)

    def openai_stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT) as r:
            chunks = sse_data(r.iter_lines())
            results["openai_first"] = next(chunks)
            first_tokens.wait(CLIENT_TIMEOUT)
            results["openai"] = list(chunks)

    def tgi_stream() -> None:
        body = {"inputs": "Write a long poem", "parameters": long}  # greedy: ~130 tokens ("Tell me a story": 6)
        with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=CLIENT_TIMEOUT) as r:
            chunks = sse_data(r.iter_lines())
            results["tgi_first"] = next(chunks)
            first_tokens.wait(CLIENT_TIMEOUT)
            results["tgi"] = list(chunks)

    def tgi_whole() -> None:
        body = {"inputs": "Write a long poem", "parameters": long}
        results["whole"] = httpx.post(f"{url}/generate", json=body, timeout=CLIENT_TIMEOUT)

    threads = [threading.Thread(target=t) for t in (openai_stream, tgi_stream, tgi_whole)]
    for thread in threads:
        thread.start()
    first_tokens.wait(CLIENT_TIMEOUT)  # both streams have a token: all three requests are running in the worker
    wait_until(lambda: value(metrics(url), "llmgw_engine_running_seqs") == 3, "three sequences running")
    os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(CLIENT_TIMEOUT)

    # each ends with its protocol's error, typed "unavailable": never a hang, a 500 or a truncated success
    openai_error = results["openai"][-1]["error"]
    assert openai_error["type"] == "service_unavailable_error" and "restarting" in openai_error["message"]
    assert results["tgi"][-1]["error_type"] == "unavailable" and "restarting" in results["tgi"][-1]["error"]
    whole = results["whole"]
    assert whole.status_code == 503 and whole.json()["error_type"] == "unavailable"

    # /health says what happened while the worker starts again, then it serves
    health = wait_until(lambda: (h := httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT)).status_code == 503 and h,
                        "/health 503 while the worker restarts")
    assert "restarting (restart" in health.json()["backends"]["local"] and "SIGKILL" in health.text
    wait_until(lambda: httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT).status_code == 200, "the worker back")
    after = metrics(url)
    assert value(after, "llmgw_engine_worker_restarts_total") == restarts_before + 1
    assert value(after, "llmgw_engine_worker_up") == 1 and value(after, "llmgw_engine_worker_pid") != pid
    again = httpx.post(f"{url}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
                       timeout=CLIENT_TIMEOUT)
    assert again.status_code == 200 and again.json()["generated_text"]


async def test_the_worker_backend_reports_its_load_and_forwards_calls(smollm_dir: Path) -> None:
    """The backend object a replica pool uses: `load()` figures, the command channel, and an abort
    that frees the worker's blocks at once."""
    backend = EngineWorkerBackend("w", EngineSettings(model=str(smollm_dir), dtype="float32", kv_cache_mb=32,
                                                      workers="process"))
    await backend.start()
    try:
        load = backend.load()
        assert isinstance(load, WorkerLoad) and load.ready and load.pid == backend.pid != os.getpid()
        assert load.kv_blocks_free == load.kv_blocks_total > 0 and load.running == 0 and load.kv_usage == 0
        assert await backend.health() and backend.state == "ready" and backend.startup_step() is None
        assert await backend.call("startup_step") is None  # any backend method, by name
        with pytest.raises(BackendValidationError, match="no method"):
            await backend.call("no_such_method")
        request = GenerationRequest(request_id="r", model="m", prompt="Once upon a time", max_new_tokens=500,
                                    ignore_eos=True)  # far more tokens than the abort lets it make
        stream = backend.generate(request)
        await anext(stream)
        busy = backend.load()
        await stream.aclose()  # the consumer left: an abort goes to the worker
        freed = await _until(backend, lambda lo: lo.all_blocks_free and lo.running == 0 and lo is not busy)
        # a count, not a clock: the worker stopped stepping the request before its last token
        assert freed.kv_blocks_free == freed.kv_blocks_total and freed.total_steps < request.max_new_tokens
    finally:
        await backend.aclose()
    assert backend.state == "closed" and not await backend.health()
    assert not worker_children()  # told to shut down, it exited


def worker_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if "backends.engine_worker" in " ".join(p.cmdline())]


async def _until(backend: EngineWorkerBackend, condition: Any) -> WorkerLoad:
    import asyncio

    async with asyncio.timeout(CLIENT_TIMEOUT):
        while True:
            load = backend.load()
            if load is not None and condition(load):
                return load
            await asyncio.sleep(0.05)


async def test_a_worker_that_cannot_load_its_model_says_why_and_leaves_no_process(tmp_path: Path) -> None:
    backend = EngineWorkerBackend("w", EngineSettings(model=str(tmp_path / "no-model-here"), workers="process"))
    with pytest.raises(RuntimeError, match="no-model-here"):
        await backend.start()
    assert backend.state == "failed" and "no-model-here" in (backend.load_error or "")
    assert backend.pid is None and not await backend.health() and backend.startup_step() is None
    await backend.aclose()
    assert not worker_children()


def test_a_token_id_past_64_bits_is_a_400_not_a_500(tmp_path: Path) -> None:
    """The worker's messages are msgpack, which has no integers past 64 bits: such a prompt is refused at
    the client with the protocol's error (found by the fuzz test), and the worker goes on serving."""
    with running_gateway(ENGINE_CONFIG, tmp_path) as url:
        response = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": [-(2**63) - 1]},
                              timeout=CLIENT_TIMEOUT)
        assert response.status_code == 400, response.text
        assert "vocabulary" in response.json()["error"]["message"]
        ok = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": [1, 2, 3], "max_tokens": 2},
                        timeout=CLIENT_TIMEOUT)
        assert ok.status_code == 200, ok.text


async def test_an_adapter_loaded_at_run_time_is_back_before_a_restarted_worker_serves(smollm_dir: Path,
                                                                                     tmp_path: Path) -> None:
    """A worker killed after an adapter was loaded through the admin API: once it is "ready" again, the
    adapter is there, so no request in between finds it missing."""
    import asyncio

    from tests.lora_helpers import make_adapter

    backend = EngineWorkerBackend("w", EngineSettings(model=str(smollm_dir), dtype="float32", kv_cache_mb=32,
                                                      workers="process"))
    await backend.start()
    try:
        await backend.load_adapter("late", make_adapter(smollm_dir, tmp_path / "late", seed=3, rank=4))
        old_pid = backend.pid
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        async with asyncio.timeout(CLIENT_TIMEOUT):
            while backend.state == "ready":  # the supervisor notices the death
                await asyncio.sleep(0.01)
            while backend.state != "ready":
                await asyncio.sleep(0.01)
        assert backend.restarts == 1 and backend.pid != old_pid
        request = GenerationRequest(request_id="after", model="m", prompt="Hello", max_new_tokens=3, adapter="late")
        async with asyncio.timeout(CLIENT_TIMEOUT):
            events = [e async for e in backend.generate(request)]
        assert events[-1].finished
    finally:
        await backend.aclose()
