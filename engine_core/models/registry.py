"""Model families by the `architectures` name in config.json, imported only when asked for (as vLLM's and
mini-sglang's registries do). Each family module provides `args_from_hf(cfg, where)` and a `Model` class."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from engine_core.attention import AttentionBackend
from engine_core.models.args import ModelArgs, ModelLoadError, read_config
from engine_core.models.decoder import DecoderModel

# architecture -> family module under engine_core.models
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen3",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Phi3ForCausalLM": "phi3",
}


def family(architecture: str) -> ModuleType:
    return importlib.import_module(f"engine_core.models.{ARCHITECTURES[architecture]}")


def load_model_args(model_dir: Path) -> ModelArgs:
    """The model's args from its config.json; an architecture or field the engine lacks is refused, named."""
    cfg = read_config(model_dir)
    config_file = model_dir / "config.json"
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{config_file}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                             f"supported: {sorted(ARCHITECTURES)}")
    try:
        return family(arch).args_from_hf(cfg, str(config_file))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{config_file}: missing or invalid field {exc}") from None


def build_model(args: ModelArgs, state: dict[str, Any], dtype: torch.dtype, max_positions: int,
                attention: AttentionBackend, device: torch.device, quantization: str = "auto") -> DecoderModel:
    return family(args.architecture).Model(args, state, dtype, max_positions, attention, device=device,
                                           quantization=quantization)
