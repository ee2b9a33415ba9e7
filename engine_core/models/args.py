"""A model's shape and switches, read once from its Hugging Face `config.json` by its family's adapter.

`ModelArgs` is what every family's forward needs to know; the family files (`engine_core/models/*.py`) each
provide `args_from_hf(cfg)` over the shared `common_args`, and refuse any field they do not implement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_core.models.layers.rotary import scaling_type


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
    # per layer: the sliding window in tokens (a position sees itself and the W - 1 before it), 0 = global
    layer_windows: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base
    partial_rotary_factor: float = 1.0  # Phi: RoPE on the first head_dim * factor dims only
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on each query and key head before RoPE
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by this ** -0.5 instead of head_dim ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: scores <- cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: logits <- cap * tanh(logits / cap)
    hidden_act: str = "silu"
    num_experts: int = 0  # MoE: experts per layer (0: a dense MLP)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()  # MoE: layers that keep a dense MLP (`mlp_only_layers`, `decoder_sparse_step`)

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def read_json_object(file: Path, error: type[Exception], missing: str) -> dict[str, Any]:
    """A JSON file holding an object, or `error` naming the file and what is wrong (`missing`: why it should
    be there)."""
    try:
        obj = json.loads(file.read_text())
    except FileNotFoundError:
        raise error(f"{file}: missing ({missing})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{file}: not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise error(f"{file}: not a JSON object")
    return obj


def read_config(model_dir: Path) -> dict[str, Any]:
    return read_json_object(model_dir / "config.json", ModelLoadError, "not a Hugging Face model directory")


def rope_settings(cfg: dict[str, Any], key: str | None = None) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either spelling: transformers 5 writes `rope_parameters` (per layer type
    for Gemma 3, under `key`), older files `rope_theta` and `rope_scaling`. Scaling is None for plain RoPE."""
    params = cfg.get("rope_parameters") or {}
    if key is not None and isinstance(params.get(key), dict):
        params = params[key]
    scaling = cfg.get("rope_scaling") if key in (None, "full_attention") else None
    if not scaling and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling and scaling_type(scaling) == "default":
        scaling = None
    theta = params.get("rope_theta") if "rope_theta" in params else cfg.get("rope_theta")
    return (None if theta is None else float(theta)), scaling


def common_args(cfg: dict[str, Any], architecture: str, **overrides: Any) -> ModelArgs:
    """The fields every family shares, with the family's own settings as overrides."""
    heads = int(cfg["num_attention_heads"])
    theta, scaling = rope_settings(cfg)
    eos = cfg.get("eos_token_id")
    fields: dict[str, Any] = dict(
        architecture=architecture,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta if theta is not None else 10000.0,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
    )
    fields.update(overrides)
    return ModelArgs(**fields)


def refuse(config: str, what: str) -> ModelLoadError:
    """A field the engine does not implement: refused at start, never served wrong."""
    return ModelLoadError(f"{config}: {what} is not supported by the engine")


def check_rope_scaling(scaling: dict[str, Any] | None, where: str, allowed: tuple[str, ...]) -> None:
    kind = scaling_type(scaling)
    if kind not in allowed:
        raise refuse(where, f"rope_scaling type {kind!r} (this family takes {', '.join(allowed)})")


def uniform_windows(cfg: dict[str, Any]) -> tuple[int, ...]:
    """`sliding_window` on every layer where the config sets one (Mistral, Phi-3), else no windows."""
    window = int(cfg.get("sliding_window") or 0)
    return (window,) * int(cfg["num_hidden_layers"]) if window else ()


def windows_from_layer_types(cfg: dict[str, Any], where: str) -> tuple[int, ...] | None:
    """Per-layer windows from transformers 5's `layer_types` where the config has them, else None."""
    types = cfg.get("layer_types")
    if types is None:
        return None
    if len(types) != int(cfg["num_hidden_layers"]) or set(types) - {"sliding_attention", "full_attention"}:
        raise refuse(where, f"layer_types {types!r}")
    window = int(cfg.get("sliding_window") or 0)
    return tuple(window if t == "sliding_attention" else 0 for t in types)
