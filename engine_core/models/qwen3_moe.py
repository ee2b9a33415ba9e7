"""Qwen3-MoE: Qwen3's attention with a sparse mixture-of-experts MLP (no shared expert) on every layer but
those in `mlp_only_layers` or off the `decoder_sparse_step` rhythm, which keep a dense MLP."""

from __future__ import annotations

from typing import Any

import torch

from engine_core.attention import AttentionBackend
from engine_core.lora.batch import LoraBatch
from engine_core.models.args import ModelArgs
from engine_core.models.decoder import DecoderModel
from engine_core.models.layers.attention import SelfAttention
from engine_core.models.layers.layer_ops import TorchLayerOps
from engine_core.models.layers.mlp import GatedMLP
from engine_core.models.layers.moe import SparseMoE
from engine_core.models.layers.rotary import RotaryEmbedding
from engine_core.models.layers.weights import Weights
from engine_core.models.qwen3 import args_from_hf as qwen3_args


class Qwen3MoeLayer:
    def __init__(self, weights: Weights, prefix: str, args: ModelArgs, index: int, rope: RotaryEmbedding,
                 sparse: bool) -> None:
        self.input_norm = weights.norm(prefix + "input_layernorm.weight", offset=False)
        self.attn = SelfAttention(weights, prefix + "self_attn.", args, index, rope)
        self.post_attention_norm = weights.norm(prefix + "post_attention_layernorm.weight", offset=False)
        self.moe = SparseMoE(weights, prefix + "mlp.", args) if sparse else None
        self.mlp = None if sparse else GatedMLP(weights, prefix + "mlp.", index, args.hidden_act)

    def __call__(self, h: torch.Tensor, x: torch.Tensor, next_norm: torch.Tensor, ops: TorchLayerOps,
                 attention: AttentionBackend, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: object,
                 lora: LoraBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        h, x = ops.add_norm(h, self.attn(x, ops, attention, k_cache, v_cache, plan, lora), self.post_attention_norm)
        mlp_out = self.moe(x, ops) if self.moe is not None else self.mlp(x, ops, lora)  # type: ignore[misc]
        return ops.add_norm(h, mlp_out, next_norm)


class Qwen3MoeModel(DecoderModel):
    def build_layer(self, weights: Weights, prefix: str, index: int) -> Qwen3MoeLayer:
        if index == 0:
            self.rotary = self.rope()
        sparse = index not in self.args.dense_layers
        return Qwen3MoeLayer(weights, prefix, self.args, index, self.rotary, sparse)


Model = Qwen3MoeModel


def args_from_hf(cfg: dict[str, Any], where: str) -> ModelArgs:
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = tuple(i for i in range(int(cfg["num_hidden_layers"]))
                  if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step)
    experts = cfg.get("num_experts") or cfg["num_local_experts"]  # transformers 5 writes the second name
    return qwen3_args(cfg, where, dense_layers=dense, num_experts=int(experts),
                      num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                      moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
