"""Model sources: the embedded model's cache, local directories, hub ids, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_core.loader import ModelLoadError, load_state_dict, resolve_model_dir
from engine_core.models.registry import load_model_args


def test_embedded_model_is_converted_once_into_the_cache(smollm_dir: Path) -> None:
    assert (smollm_dir / "config.json").is_file() and list(smollm_dir.glob("*.safetensors"))
    assert (smollm_dir / "tokenizer.json").is_file()
    args = load_model_args(smollm_dir)
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.hidden_size) == (30, 9, 3, 576)
    assert resolve_model_dir("embedded") == smollm_dir


def test_cache_location_follows_the_environment_variable(tmp_path: Path, smollm_dir: Path) -> None:
    target = tmp_path / "SmolLM2-135M-Instruct"
    target.symlink_to(smollm_dir)  # already converted: resolving must find it, not convert again
    code = "from engine_core.loader import resolve_model_dir; print(resolve_model_dir('embedded'))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "LLMGW_MODEL_CACHE": str(tmp_path)},
                         capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == str(target)


def test_hub_id_without_network_names_the_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=r"model 'someorg/some-model-that-is-not-here' is not in the local "
                                             r"Hugging Face cache .* `hf download someorg/some-model-that-is-not"):
        resolve_model_dir("someorg/some-model-that-is-not-here")


def test_missing_directory_and_missing_config_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such directory"):
        resolve_model_dir(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match=r"config.json: missing"):
        load_model_args(tmp_path)


def test_unsupported_architecture_names_file_and_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match=r"config.json: unsupported architecture \['GPT2LMHeadModel'\]"):
        load_model_args(tmp_path)


def test_broken_config_and_weights_are_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model_args(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="missing or invalid field 'num_attention_heads'"):
        load_model_args(tmp_path)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_state_dict(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="model.safetensors: cannot read weights"):
        load_state_dict(tmp_path)
