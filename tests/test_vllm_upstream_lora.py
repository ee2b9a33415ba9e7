"""A LoRA adapter served by a real vLLM (`--enable-lora --lora-modules`), reached by the clients' name
through both doors of the gateway: OpenAI `model` and TGI `adapter_id` map to vLLM's adapter name."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient

from tests.server import CLIENT_TIMEOUT, running_gateway
from tests.vllm_server import LORA_NAME, SERVED_NAME, vllm_gateway_config

CLIENT_NAME = "support-lora"  # what the clients call it; the config maps it to vLLM's LORA_NAME
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def via_vllm(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = vllm_gateway_config(vllm_url, backend_extra=f'lora_adapters = {{ {CLIENT_NAME} = "{LORA_NAME}" }}')
    with running_gateway(config, tmp_path_factory.mktemp("via-vllm-lora")) as url:
        yield url


def direct(vllm_url: str, model: str) -> str:
    r = httpx.post(f"{vllm_url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 12,
                                                       "temperature": 0}, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_vllm_serves_the_adapter_and_it_changes_the_output(vllm_url: str) -> None:
    ids = {m["id"]: m for m in httpx.get(f"{vllm_url}/v1/models", timeout=CLIENT_TIMEOUT).json()["data"]}
    assert ids[LORA_NAME]["parent"] == SERVED_NAME
    assert direct(vllm_url, LORA_NAME) != direct(vllm_url, SERVED_NAME)


def test_openai_door_reaches_the_adapter_by_the_clients_name(via_vllm: str, vllm_url: str) -> None:
    client = openai.OpenAI(base_url=f"{via_vllm}/v1", api_key="unused", timeout=CLIENT_TIMEOUT, max_retries=0)
    reply = client.completions.create(model=CLIENT_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert reply.model == CLIENT_NAME
    assert reply.choices[0].text == direct(vllm_url, LORA_NAME)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=CLIENT_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == reply.choices[0].text
    cards = {m.id: m for m in client.models.list().data}
    assert cards[CLIENT_NAME].model_extra["parent"] == "smollm"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=LORA_NAME, prompt=PROMPT, max_tokens=2)  # vLLM's name is not the clients'


def test_tgi_door_reaches_the_adapter_by_adapter_id(via_vllm: str, vllm_url: str) -> None:
    tgi = InferenceClient(model=via_vllm, timeout=CLIENT_TIMEOUT)
    want = direct(vllm_url, LORA_NAME)
    ask = {"max_new_tokens": 12, "return_full_text": False}  # the client posts to `/`, which prepends the prompt
    assert tgi.text_generation(PROMPT, adapter_id=CLIENT_NAME, **ask) == want
    assert "".join(tgi.text_generation(PROMPT, adapter_id=CLIENT_NAME, stream=True, **ask)) == want
    assert tgi.text_generation(PROMPT, **ask) == direct(vllm_url, SERVED_NAME)
