"""Speculative decoding through every door of a real gateway: greedy answers are the engine's answers
without speculation, for prompts that repeat (drafts accepted) and that do not; /info and check-config say
how the engine speculates."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from huggingface_hub import InferenceClient

from engine_core import EngineConfig, LLMEngine, SamplingParams
from tests.server import CLIENT_TIMEOUT, ROOT, running_gateway

NEW = 40
CONFIG = """
default_model = "smollm2"

[backends.local]
type = "engine"
model = "embedded"
dtype = "float32"
kv_cache_mb = 128
max_num_seqs = 8

[backends.local.speculative]
method = "ngram"
num_speculative_tokens = 4
prompt_lookup_min = 2
prompt_lookup_max = 4

[models.smollm2]
backend = "local"
max_total_tokens = 2048
"""
PROMPTS = ["Continue the list: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,",
           "Say something kind to a friend."]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("spec-gateway")
    with running_gateway(CONFIG, tmp) as url:
        yield url


@pytest.fixture(scope="module")
def reference(smollm_dir: Path) -> LLMEngine:
    """The engine in this process without speculation: the greedy answers to expect."""
    return LLMEngine(EngineConfig(model=str(smollm_dir), dtype="float32", num_blocks=128))


def expected(engine: LLMEngine, prompt: str, chat: bool) -> str:
    if chat:
        rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                        add_generation_prompt=True)
        ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
    else:
        ids = engine.tokenize(prompt)
    return "".join(o.text for o in engine.generate([ids], SamplingParams(max_new_tokens=NEW))[0])


def accepted_tokens(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("llmgw_engine_spec_decode_num_accepted_tokens_total"))


@pytest.mark.parametrize("prompt", PROMPTS, ids=["repeating", "open"])
def test_greedy_answers_match_the_engine_without_speculation_through_every_door(
        gateway: str, reference: LLMEngine, prompt: str) -> None:
    chat_want, text_want = expected(reference, prompt, chat=True), expected(reference, prompt, chat=False)
    messages = [{"role": "user", "content": prompt}]
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", timeout=CLIENT_TIMEOUT, max_retries=0)
    chat = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=NEW, temperature=0)
    assert chat.choices[0].message.content == chat_want
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=NEW, temperature=0, stream=True) if c.choices)
    assert streamed == chat_want
    done = client.completions.create(model="smollm2", prompt=prompt, max_tokens=NEW, temperature=0)
    assert done.choices[0].text == text_want
    response = client.responses.create(model="smollm2", input=prompt, max_output_tokens=NEW, temperature=0)
    assert response.output_text == chat_want
    claude = anthropic.Anthropic(base_url=gateway, api_key="unused", timeout=CLIENT_TIMEOUT, max_retries=0)
    message = claude.messages.create(model="smollm2", max_tokens=NEW, messages=messages,
                                     extra_body={"temperature": 0})
    assert message.content[0].text == chat_want
    tgi = InferenceClient(model=gateway, timeout=CLIENT_TIMEOUT)
    assert tgi.text_generation(prompt, max_new_tokens=NEW, return_full_text=False) == text_want
    assert "".join(tgi.text_generation(prompt, max_new_tokens=NEW, stream=True)) == text_want


def test_the_repeating_prompt_was_speculated(gateway: str) -> None:
    before = accepted_tokens(gateway)
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", timeout=CLIENT_TIMEOUT, max_retries=0)
    client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=NEW, temperature=0)
    assert accepted_tokens(gateway) - before >= NEW // 4


def test_info_and_check_config_say_how_the_engine_speculates(gateway: str, tmp_path: Path) -> None:
    info = httpx.get(f"{gateway}/info", timeout=CLIENT_TIMEOUT).json()
    assert info["speculative"].startswith("ngram: up to 4 draft tokens a step (prompt lookup n-gram 2-4)")
    config = tmp_path / "config.toml"
    config.write_text(CONFIG)
    checked = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(config)], cwd=ROOT,
                             capture_output=True, text=True, timeout=CLIENT_TIMEOUT)
    assert checked.returncode == 0, checked.stderr
    assert "speculative decoding ngram: up to 4 draft tokens" in checked.stdout + checked.stderr
    config.write_text(CONFIG.replace('method = "ngram"', 'method = "eagle"'))
    refused = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(config)], cwd=ROOT,
                             capture_output=True, text=True, timeout=CLIENT_TIMEOUT)
    assert refused.returncode != 0 and "eagle" in refused.stdout + refused.stderr
