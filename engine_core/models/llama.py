"""Llama 1/2/3.x (and SmolLM, and Mistral with its sliding window): the family to copy for a new dense model.

A family file is a decoder layer composed of the shared layers, a model class naming it, and `args_from_hf`,
which reads the family's fields from config.json and refuses what the forward does not implement.
"""

from __future__ import annotations

from typing import Any

import torch

from engine_core.attention import AttentionBackend
from engine_core.lora.batch import LoraBatch
from engine_core.models.args import ModelArgs, check_rope_scaling, common_args, uniform_windows
from engine_core.models.decoder import DecoderModel
from engine_core.models.layers.attention import SelfAttention
from engine_core.models.layers.layer_ops import TorchLayerOps
from engine_core.models.layers.mlp import GatedMLP
from engine_core.models.layers.rotary import RotaryEmbedding
from engine_core.models.layers.weights import Weights


class LlamaLayer:
    """Pre-norm: h += attn(norm(h)); h += mlp(norm(h))."""

    def __init__(self, weights: Weights, prefix: str, args: ModelArgs, index: int, rope: RotaryEmbedding) -> None:
        self.input_norm = weights.norm(prefix + "input_layernorm.weight", offset=False)
        self.attn = SelfAttention(weights, prefix + "self_attn.", args, index, rope)
        self.post_attention_norm = weights.norm(prefix + "post_attention_layernorm.weight", offset=False)
        self.mlp = GatedMLP(weights, prefix + "mlp.", index, args.hidden_act)

    def __call__(self, h: torch.Tensor, x: torch.Tensor, next_norm: torch.Tensor, ops: TorchLayerOps,
                 attention: AttentionBackend, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: object,
                 lora: LoraBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        h, x = ops.add_norm(h, self.attn(x, ops, attention, k_cache, v_cache, plan, lora), self.post_attention_norm)
        return ops.add_norm(h, self.mlp(x, ops, lora), next_norm)


class LlamaModel(DecoderModel):
    def build_layer(self, weights: Weights, prefix: str, index: int) -> LlamaLayer:
        if index == 0:
            self.rotary = self.rope()  # one table for every layer
        return LlamaLayer(weights, prefix, self.args, index, self.rotary)


Model = LlamaModel


def args_from_hf(cfg: dict[str, Any], where: str) -> ModelArgs:
    args = common_args(cfg, cfg["architectures"][0], layer_windows=uniform_windows(cfg))  # Mistral: all slide
    check_rope_scaling(args.rope_scaling, where, ("default", "linear", "dynamic", "llama3"))
    return args
