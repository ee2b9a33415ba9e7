"""Every family through a real gateway process: the TGI door with and without a LoRA adapter on the family's
own projections (Phi-3's fused qkv_proj and gate_up_proj, the MoE's attention), greedy tokens equal to peft's
merged model; and the OpenAI door's chat template, forced tool call, structured output and stop strings.

The checkpoints are the tiny random-weight ones of test_model_families (SmolLM2's tokenizer and chat template),
each served by an in-process engine, so one gateway holds them all."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.family_models import FAMILIES, build_family_model
from tests.lora_helpers import make_adapter, merged_model, teacher_forced_argmax
from tests.server import CLIENT_TIMEOUT, running_gateway

NEW = 10
# 78 tokens: longer than the 24-token windows, and than Phi-3's original 64 positions (its longrope factors are
# chosen once per deployment, the long ones here, where transformers switches at 64)
PROMPT = "The quick brown fox jumps over the lazy dog, " * 7
# the projections each family's checkpoints (and so its PEFT adapters) name
TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
           "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"]}  # the experts take no adapter
UNIT = {"type": "function", "function": {
    "name": "get_unit", "description": "Choose a temperature unit",
    "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["unit"], "additionalProperties": False}}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def checkpoints(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """family -> (model directory, adapter directory)"""
    root = tmp_path_factory.mktemp("served-families")
    made = {}
    for i, family in enumerate(sorted(FAMILIES)):
        model_dir = build_family_model(family, root / family, smollm_dir)
        adapter = make_adapter(model_dir, root / f"{family}-lora", seed=40 + i, rank=4, scale=4.0,
                               target_modules=TARGETS.get(family))
        made[family] = (model_dir, adapter)
    return made


@pytest.fixture(scope="module")
def gateway(checkpoints: dict[str, tuple[Path, Path]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    sections = []
    for family, (model_dir, adapter) in checkpoints.items():
        sections.append(f"""
[backends.{family}]
type = "engine"
model = "{model_dir}"
dtype = "float32"
workers = "thread"
kv_cache_mb = 8
max_num_seqs = 4
lora_adapters = {{ {family}-lora = "{adapter}" }}

[models.{family}]
backend = "{family}"
max_total_tokens = 512
""")
    with running_gateway(f'default_model = "llama3"\n{"".join(sections)}', tmp_path_factory.mktemp("gw")) as url:
        yield url


@pytest.fixture(scope="module")
def client(gateway: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway}/v1", api_key="unused", timeout=CLIENT_TIMEOUT, max_retries=0)


def _tgi_generate(url: str, family: str, adapter: str | None) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of a greedy TGI /generate."""
    parameters = {"max_new_tokens": NEW, "details": True, "decoder_input_details": True}
    if adapter:
        parameters["adapter_id"] = adapter
    response = httpx.post(f"{url}/models/{family}/generate", json={"inputs": PROMPT, "parameters": parameters},
                          timeout=CLIENT_TIMEOUT)
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    return [t["id"] for t in details["prefill"]], [t["id"] for t in details["tokens"]]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tgi_greedy_with_and_without_the_adapter_equals_peft(family: str, gateway: str,
                                                             checkpoints: dict[str, tuple[Path, Path]]) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, adapter_dir = checkpoints[family]
    prompt, base = _tgi_generate(gateway, family, None)
    _, adapted = _tgi_generate(gateway, family, f"{family}-lora")
    assert len(base) == len(adapted) == NEW
    assert base != adapted  # the adapter changes the output (scaled up so it does)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    assert base == teacher_forced_argmax(reference, prompt, base)
    assert adapted == teacher_forced_argmax(merged_model(model_dir, adapter_dir), prompt, adapted)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_openai_chat_tools_structured_output_and_stop_strings(family: str, client: OpenAI) -> None:
    ask = [{"role": "user", "content": "Which unit should I use?"}]
    chat = client.chat.completions.create(model=family, messages=ask, max_tokens=8, temperature=0)
    assert chat.usage.prompt_tokens > 10  # the checkpoint's chat template wrapped the message

    call = client.chat.completions.create(model=family, messages=ask, tools=[UNIT], max_tokens=60, temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "get_unit"}})
    [tool_call] = call.choices[0].message.tool_calls
    jsonschema.validate(json.loads(tool_call.function.arguments), UNIT["function"]["parameters"])

    structured = client.chat.completions.create(
        model=family, messages=ask, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    jsonschema.validate(json.loads(structured.choices[0].message.content), ANSWER)

    free = client.completions.create(model=family, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = next(free[i:i + 3] for i in range(len(free) // 2, len(free) - 2) if free[i:i + 3].strip())
    stopped = client.completions.create(model=family, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free[:free.index(stop)]
