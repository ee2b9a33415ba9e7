"""Gemma 2 and Gemma 3 (text): Llama's skeleton with Gemma's switches.

- (1 + w) RMSNorm computed in fp32, four per layer ("sandwich": a norm after attention and after the MLP too);
- embeddings scaled by sqrt(hidden); GeGLU with tanh-GELU; scores scaled by `query_pre_attn_scalar`^-0.5;
- sliding and global layers (`layer_types`; Gemma 2 alternates, Gemma 3 slides 5 of 6);
- Gemma 2: attention and final-logit soft-capping; Gemma 3: q/k-norm, and a local RoPE base for sliding layers
  beside the global one (a legacy `rope_scaling` applies to the global layers only).
"""

from __future__ import annotations

from typing import Any

import torch

from engine_core.attention import AttentionBackend
from engine_core.lora.batch import LoraBatch
from engine_core.models.args import (
    ModelArgs,
    check_rope_scaling,
    common_args,
    refuse,
    rope_settings,
    windows_from_layer_types,
)
from engine_core.models.decoder import DecoderModel
from engine_core.models.layers.attention import SelfAttention
from engine_core.models.layers.layer_ops import TorchLayerOps
from engine_core.models.layers.mlp import GatedMLP
from engine_core.models.layers.rotary import RotaryEmbedding
from engine_core.models.layers.weights import Weights


class GemmaLayer:
    """h += post_attn_norm(attn(input_norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h)))."""

    def __init__(self, weights: Weights, prefix: str, args: ModelArgs, index: int, rope: RotaryEmbedding) -> None:
        def norm(name: str) -> torch.Tensor:
            return weights.norm(prefix + name + ".weight", offset=True)

        self.input_norm = norm("input_layernorm")
        self.attn = SelfAttention(weights, prefix + "self_attn.", args, index, rope, gemma_norms=True)
        self.post_attention_norm = norm("post_attention_layernorm")
        self.pre_feedforward_norm = norm("pre_feedforward_layernorm")
        self.mlp = GatedMLP(weights, prefix + "mlp.", index, args.hidden_act)
        self.post_feedforward_norm = norm("post_feedforward_layernorm")

    def __call__(self, h: torch.Tensor, x: torch.Tensor, next_norm: torch.Tensor, ops: TorchLayerOps,
                 attention: AttentionBackend, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: object,
                 lora: LoraBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        attn_out = ops.norm(self.attn(x, ops, attention, k_cache, v_cache, plan, lora), self.post_attention_norm)
        h, x = ops.add_norm(h, attn_out, self.pre_feedforward_norm)
        return ops.add_norm(h, ops.norm(self.mlp(x, ops, lora), self.post_feedforward_norm), next_norm)


class GemmaModel(DecoderModel):
    gemma_norms = True
    scale_embeddings = True

    def build_layer(self, weights: Weights, prefix: str, index: int) -> GemmaLayer:
        if index == 0:
            self.global_rope = self.rope()
            local = self.args.rope_local_theta
            self.local_rope = self.rope(local, None) if local is not None else self.global_rope
        rope = self.local_rope if self.args.window(index) else self.global_rope
        return GemmaLayer(weights, prefix, self.args, index, rope)


Model = GemmaModel


def args_from_hf(cfg: dict[str, Any], where: str) -> ModelArgs:
    arch = cfg["architectures"][0]
    gemma3 = arch.startswith("Gemma3")
    if cfg.get("use_bidirectional_attention"):
        raise refuse(where, "use_bidirectional_attention (an embedding model, not a causal LM)")
    layers = int(cfg["num_hidden_layers"])
    windows = windows_from_layer_types(cfg, where)
    if windows is None:  # configs from before transformers 5 name the pattern, or take the family's default
        pattern = int(cfg.get("sliding_window_pattern") or (6 if gemma3 else 2))
        window = int(cfg.get("sliding_window") or 0)
        windows = tuple(window if (i + 1) % pattern else 0 for i in range(layers))
    if gemma3:
        global_theta, scaling = rope_settings(cfg, "full_attention")
        local_theta, local_scaling = rope_settings(cfg, "sliding_attention")
        if local_scaling:
            raise refuse(where, "rope scaling on the sliding layers")
        global_theta = global_theta or 1_000_000.0
        local_theta = local_theta or float(cfg.get("rope_local_base_freq") or 10_000.0)
    else:
        global_theta, scaling = rope_settings(cfg)
        local_theta = None
    check_rope_scaling(scaling, where, ("default", "linear"))
    return common_args(
        cfg, arch, rope_theta=global_theta or 10000.0, rope_scaling=scaling, rope_local_theta=local_theta,
        layer_windows=windows, qk_norm=gemma3, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        # Gemma 2 caps by default (50, 30), Gemma 3 does not; a config's explicit null turns a cap off
        attn_logit_softcap=cfg.get("attn_logit_softcapping", None if gemma3 else 50.0) or None,
        final_logit_softcap=cfg.get("final_logit_softcapping", None if gemma3 else 30.0) or None,
        hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"),
        head_dim=int(cfg.get("head_dim") or 256))
