"""Qwen2/2.5 and Qwen3: the Llama layer with one switch each. Qwen2 has q/k/v biases (taken from the
checkpoint); Qwen3 has per-head q/k RMSNorm before RoPE and an explicit head_dim. Both slide the layers from
`max_window_layers` on when `use_sliding_window` is set (or as transformers 5's `layer_types` say)."""

from __future__ import annotations

from typing import Any

from engine_core.models.args import ModelArgs, check_rope_scaling, common_args, windows_from_layer_types
from engine_core.models.llama import LlamaModel


def qwen_windows(cfg: dict[str, Any], where: str) -> tuple[int, ...]:
    windows = windows_from_layer_types(cfg, where)
    if windows is not None:
        return windows
    window = int(cfg.get("sliding_window") or 0) if cfg.get("use_sliding_window") else 0
    first = int(cfg.get("max_window_layers", 28))
    return tuple(window if i >= first else 0 for i in range(int(cfg["num_hidden_layers"])))


def args_from_hf(cfg: dict[str, Any], where: str, **overrides: Any) -> ModelArgs:
    arch = cfg["architectures"][0]
    qwen3 = arch.startswith("Qwen3")
    args = common_args(cfg, arch, qk_norm=qwen3, layer_windows=qwen_windows(cfg, where), **overrides)
    check_rope_scaling(args.rope_scaling, where, ("default", "linear", "dynamic", "llama3"))
    return args


Model = LlamaModel  # the switches are in the args and the checkpoint
