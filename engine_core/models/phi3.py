"""Phi-3 and Phi-4-mini: the Llama layer over fused `qkv_proj` and `gate_up_proj` checkpoint tensors (taken as
they are), partial rotary (`partial_rotary_factor`), longrope with its factors chosen once per deployment, and
a sliding window on every layer where the config sets one."""

from __future__ import annotations

from typing import Any

from engine_core.models.args import ModelArgs, check_rope_scaling, common_args, rope_settings, uniform_windows
from engine_core.models.llama import LlamaModel


def args_from_hf(cfg: dict[str, Any], where: str) -> ModelArgs:
    _, scaling = rope_settings(cfg)
    if scaling is not None:
        # longrope reads these beside its factors; older configs keep them at the top level
        scaling = {"original_max_position_embeddings": cfg.get("original_max_position_embeddings"),
                   "max_position_embeddings": cfg.get("max_position_embeddings"), **scaling}
    check_rope_scaling(scaling, where, ("default", "longrope"))
    params = cfg.get("rope_parameters") or {}
    factor = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
    return common_args(cfg, cfg["architectures"][0], rope_scaling=scaling, partial_rotary_factor=factor,
                       layer_windows=uniform_windows(cfg))


Model = LlamaModel
