"""LoRA adapters through the doors of a real gateway process: OpenAI `model` (chat, completions, Responses),
Anthropic `model`, TGI `adapter_id` (and TGI chat's `model`), /v1/models, unknown names, runtime load and unload,
metrics and the access log; and through a second gateway's `tgi` and `triton` backends."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient

from engine_core import EngineConfig, LLMEngine, SamplingParams
from tests.lora_helpers import make_adapter
from tests.server import CLIENT_TIMEOUT, running_gateway, wait_until

ADMIN = {"authorization": "Bearer lora-admin-key"}
NEW = 10


@pytest.fixture(scope="module")
def adapter_dirs(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("door-adapters")
    return {"sql-lora": make_adapter(smollm_dir, root / "a1", seed=11, rank=8),
            "chat-lora": make_adapter(smollm_dir, root / "a2", seed=12, rank=4, target_modules=["q_proj", "v_proj"])}


@pytest.fixture(scope="module")
def gateway(adapter_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("lora-gateway")
    config = f"""
default_model = "smollm2"

[server]
admin_key = "lora-admin-key"

[backends.local]
type = "engine"
model = "embedded"
dtype = "float32"
kv_cache_mb = 128
max_num_seqs = 8
max_loras = 2
lora_adapters = {{ sql-lora = "{adapter_dirs['sql-lora']}" }}

[models.smollm2]
backend = "local"
max_total_tokens = 2048
default_max_new_tokens = 16
"""
    with running_gateway(config, tmp) as url:
        yield url, tmp / "server.log"


@pytest.fixture(scope="module")
def reference(smollm_dir: Path, adapter_dirs: dict[str, Path]) -> LLMEngine:
    """The engine in this process, with the same adapters, for the greedy answers to expect."""
    return LLMEngine(EngineConfig(model=str(smollm_dir), dtype="float32", num_blocks=128,
                                  lora_adapters={n: str(p) for n, p in adapter_dirs.items()}))


def expected(engine: LLMEngine, prompt: str | list[int], adapter: str | None, n: int = NEW) -> str:
    out = engine.generate([prompt], SamplingParams(max_new_tokens=n, adapter=adapter))[0]
    return "".join(o.text for o in out)


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


@pytest.fixture(scope="module")
def client(gateway: tuple[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway[0]}/v1", api_key="unused", timeout=CLIENT_TIMEOUT, max_retries=0)


def test_openai_model_names_the_adapter_on_chat_and_completions(client: openai.OpenAI, reference: LLMEngine) -> None:
    prompt = "Write a query that counts the users"
    reply = client.chat.completions.create(model="sql-lora", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=NEW, temperature=0)
    assert reply.model == "sql-lora"
    assert reply.choices[0].message.content == expected(reference, chat_ids(reference, prompt), "sql-lora")
    base = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=NEW, temperature=0)
    assert base.choices[0].message.content == expected(reference, chat_ids(reference, prompt), None)
    assert base.choices[0].message.content != reply.choices[0].message.content
    done = client.completions.create(model="sql-lora", prompt="SELECT", max_tokens=NEW, temperature=0)
    assert done.choices[0].text == expected(reference, "SELECT", "sql-lora")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="sql-lora", prompt="SELECT", max_tokens=NEW, temperature=0, stream=True) if c.choices)
    assert streamed == done.choices[0].text


def test_v1_models_lists_adapters_with_their_parent(client: openai.OpenAI, adapter_dirs: dict[str, Path]) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert "smollm2" in cards and "sql-lora" in cards
    assert cards["sql-lora"].model_extra["parent"] == "smollm2"
    assert cards["sql-lora"].model_extra["root"] == str(adapter_dirs["sql-lora"])


def test_tgi_adapter_id_on_generate_generate_stream_and_compat(gateway: tuple[str, Path],
                                                                reference: LLMEngine) -> None:
    url = gateway[0]
    want = expected(reference, "SELECT", "sql-lora")
    tgi = InferenceClient(model=url, timeout=CLIENT_TIMEOUT)
    ask = {"max_new_tokens": NEW, "adapter_id": "sql-lora", "return_full_text": False}
    assert tgi.text_generation("SELECT", **ask) == want
    assert "".join(tgi.text_generation("SELECT", stream=True, **ask)) == want
    compat = httpx.post(f"{url}/", json={"inputs": "SELECT", "parameters": {"max_new_tokens": NEW,
                                                                           "adapter_id": "sql-lora"}},
                        timeout=CLIENT_TIMEOUT)
    assert compat.status_code == 200 and compat.json()[0]["generated_text"] == "SELECT" + want  # full text on `/`
    base = tgi.text_generation("SELECT", max_new_tokens=NEW, return_full_text=False)
    assert base == expected(reference, "SELECT", None) != want


def test_an_unknown_adapter_is_a_404_in_each_protocols_shape(gateway: tuple[str, Path],
                                                             client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-lora", messages=[{"role": "user", "content": "hi"}])
    assert "The model `no-such-lora` does not exist." in str(caught.value)
    for route in ("/generate", "/generate_stream"):
        r = httpx.post(f"{gateway[0]}{route}", json={"inputs": "hi", "parameters": {"adapter_id": "no-such-lora"}},
                       timeout=CLIENT_TIMEOUT)
        body = r.json() if route == "/generate" else json.loads(r.text.split("data:", 1)[1])
        assert body["error_type"] == "model_not_found", body
        assert "no LoRA adapter `no-such-lora`" in body["error"] and "sql-lora" in body["error"]
        assert r.status_code == (404 if route == "/generate" else 200)  # TGI streams errors as events


def test_base_and_two_adapters_sent_together_each_get_their_own_outputs(
        gateway: tuple[str, Path], client: openai.OpenAI, reference: LLMEngine,
        adapter_dirs: dict[str, Path]) -> None:
    url = gateway[0]
    loaded = httpx.post(f"{url}/admin/lora", headers=ADMIN, timeout=CLIENT_TIMEOUT,
                        json={"name": "chat-lora", "path": str(adapter_dirs["chat-lora"])})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json() == {"name": "chat-lora", "model": "smollm2", "backends": ["local"], "loaded": True}
    try:
        names = [None, "sql-lora", "chat-lora"] * 2

        def ask(name: str | None) -> str:
            r = client.completions.create(model=name or "smollm2", prompt="The capital of France is",
                                          max_tokens=NEW, temperature=0)
            return r.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            got = list(pool.map(ask, names))
        want = [expected(reference, "The capital of France is", n) for n in names]
        assert got == want
        assert len(set(want)) == 3
    finally:
        httpx.post(f"{url}/admin/lora", headers=ADMIN, json={"name": "chat-lora", "unload": True},
                   timeout=CLIENT_TIMEOUT)


def test_vllm_runtime_routes_load_and_unload_and_tgi_chat_takes_the_adapter_as_model(
        gateway: tuple[str, Path], client: openai.OpenAI, adapter_dirs: dict[str, Path]) -> None:
    url = gateway[0]
    body = {"lora_name": "chat-lora", "lora_path": str(adapter_dirs["chat-lora"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=CLIENT_TIMEOUT).status_code == 401
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat-lora' added successfully."
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=CLIENT_TIMEOUT)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    # TGI's chat route: `model` other than "tgi" is the adapter
    chat = InferenceClient(model=url, timeout=CLIENT_TIMEOUT).chat_completion(
        [{"role": "user", "content": "hello"}], model="chat-lora", max_tokens=4)
    assert chat.model == "chat-lora" and chat.choices[0].message.content
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat-lora"}, headers=ADMIN,
                   timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat-lora' removed successfully."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat-lora", prompt="hi", max_tokens=2)
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat-lora"}, headers=ADMIN,
                      timeout=CLIENT_TIMEOUT)
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == "The lora adapter 'chat-lora' cannot be found."


def test_a_bad_adapter_directory_is_refused_with_the_reason(gateway: tuple[str, Path], tmp_path: Path,
                                                            smollm_dir: Path) -> None:
    big = make_adapter(smollm_dir, tmp_path / "r32", seed=13, rank=32)
    for path, reason in [(tmp_path / "absent", "no such directory"), (tmp_path, "adapter_config.json: missing"),
                         (big, "rank 32 exceeds max_lora_rank 16")]:
        r = httpx.post(f"{gateway[0]}/admin/lora", headers=ADMIN, json={"name": "bad", "path": str(path)},
                       timeout=CLIENT_TIMEOUT)
        assert r.status_code == 400 and reason in r.json()["error"], r.text
    cards = httpx.get(f"{gateway[0]}/v1/models", timeout=CLIENT_TIMEOUT).json()["data"]
    assert "bad" not in {c["id"] for c in cards}


def test_unload_while_a_request_is_in_flight_is_refused_with_409(gateway: tuple[str, Path],
                                                                  adapter_dirs: dict[str, Path]) -> None:
    url = gateway[0]
    load = {"name": "chat-lora", "path": str(adapter_dirs["chat-lora"])}
    assert httpx.post(f"{url}/admin/lora", headers=ADMIN, json=load, timeout=CLIENT_TIMEOUT).status_code == 200
    started = threading.Event()
    finished: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{url}/generate_stream", timeout=CLIENT_TIMEOUT, json={
                "inputs": "Once upon a time", "parameters": {"adapter_id": "chat-lora", "max_new_tokens": 400}}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    started.set()
                    if '"generated_text":null' not in line.replace(" ", ""):
                        finished.append(line)

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert started.wait(CLIENT_TIMEOUT)
        r = httpx.post(f"{url}/admin/lora", headers=ADMIN, json={"name": "chat-lora", "unload": True},
                       timeout=CLIENT_TIMEOUT)
        assert r.status_code == 409 and "in use by 1 request" in r.json()["error"], r.text
    finally:
        worker.join(CLIENT_TIMEOUT)
    assert len(finished) == 1 and '"index":400' in finished[0]  # it went on to its end, on its adapter
    r = wait_until(lambda: (x := httpx.post(f"{url}/admin/lora", headers=ADMIN, timeout=CLIENT_TIMEOUT,
                                            json={"name": "chat-lora", "unload": True})).status_code == 200 and x,
                   "the unload after the request finished")
    assert r.json()["loaded"] is False


def test_metrics_and_access_log_carry_the_adapter(gateway: tuple[str, Path], client: openai.OpenAI) -> None:
    url, log = gateway
    client.completions.create(model="sql-lora", prompt="metrics", max_tokens=3, temperature=0)
    metrics = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text
    assert 'llmgw_adapter_requests_total{adapter="sql-lora",model="smollm2",status="200"}' in metrics
    assert 'llmgw_adapter_generation_tokens_total{adapter="sql-lora",model="smollm2"}' in metrics

    def adapter_lines() -> list[dict]:
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        return [line for line in lines if line.get("event") == "request" and line.get("adapter") == "sql-lora"]

    lines = wait_until(adapter_lines, "an access log line with the adapter")
    assert lines[-1]["model"] == "smollm2" and lines[-1]["route"] == "/v1/completions"


@pytest.fixture(scope="module")
def front(gateway: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second gateway in front of the first: a `tgi` backend that maps its clients' adapter name to the
    upstream's adapter_id, and a `triton` backend, which has no adapters."""
    config = f"""
default_model = "relayed"

[backends.upstream-tgi]
type = "tgi"
base_url = "{gateway[0]}"
lora_adapters = {{ client-lora = "sql-lora" }}

[backends.trt]
type = "triton"
base_url = "{gateway[0]}"

[models.relayed]
backend = "upstream-tgi"

[models.trt]
backend = "trt"
"""
    # the triton backend has no Triton behind it, so /health stays 503: wait for the tgi backend's route instead
    with running_gateway(config, tmp_path_factory.mktemp("lora-front"), wait_healthy=False) as url:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT).json()["backends"].get("upstream-tgi")
                   == "healthy", "the tgi backend is up")
        yield url


def test_a_tgi_backend_passes_the_mapped_adapter_id(front: str, reference: LLMEngine) -> None:
    tgi = InferenceClient(model=front, timeout=CLIENT_TIMEOUT)
    want = expected(reference, "SELECT", "sql-lora")
    assert tgi.text_generation("SELECT", max_new_tokens=NEW, adapter_id="client-lora", return_full_text=False) == want
    client = openai.OpenAI(base_url=f"{front}/v1", api_key="unused", timeout=CLIENT_TIMEOUT, max_retries=0)
    done = client.completions.create(model="client-lora", prompt="SELECT", max_tokens=NEW, temperature=0)
    assert done.model == "client-lora" and done.choices[0].text == want
    # the upstream's own name is not one this gateway's clients use
    r = httpx.post(f"{front}/generate", json={"inputs": "SELECT", "parameters": {"adapter_id": "sql-lora"}},
                   timeout=CLIENT_TIMEOUT)
    assert r.status_code == 404 and "client-lora" in r.json()["error"]


def test_a_triton_backend_refuses_adapters(front: str) -> None:
    r = httpx.post(f"{front}/models/trt/generate", json={"inputs": "hi", "parameters": {"adapter_id": "client-lora"}},
                   timeout=CLIENT_TIMEOUT)
    assert r.status_code == 404 and "model `trt` has no LoRA adapter `client-lora` (loaded: [])" in r.json()["error"]


async def test_the_triton_backend_itself_refuses_an_adapter_request_before_any_http() -> None:
    from backends.base import BackendValidationError, GenerationRequest
    from backends.triton import TritonBackend, TritonSettings

    backend = TritonBackend("trt", TritonSettings(base_url="http://127.0.0.1:9"))  # nothing listens there
    try:
        with pytest.raises(BackendValidationError, match="cannot serve LoRA adapter 'x'"):
            async for _ in backend.generate(GenerationRequest(request_id="r", model="m", prompt="hi", adapter="x")):
                pass
    finally:
        await backend.aclose()


def test_responses_and_messages_doors_take_the_adapter_as_model(gateway: tuple[str, Path], client: openai.OpenAI,
                                                                 reference: LLMEngine) -> None:
    import anthropic

    prompt = "Write a query that counts the users"
    want = expected(reference, chat_ids(reference, prompt), "sql-lora")
    reply = client.responses.create(model="sql-lora", input=prompt, max_output_tokens=NEW, temperature=0)
    assert reply.model == "sql-lora" and reply.output_text == want
    messages = anthropic.Anthropic(base_url=gateway[0], api_key="unused", timeout=CLIENT_TIMEOUT, max_retries=0)
    message = messages.messages.create(model="sql-lora", max_tokens=NEW, extra_body={"temperature": 0},
                                       messages=[{"role": "user", "content": prompt}])
    assert message.model == "sql-lora" and message.content[0].text == want
