"""Self-attention over the paged KV cache, with the switches the families differ by: biases (Qwen2), a fused
q|k|v checkpoint tensor (Phi-3), per-head q/k RMSNorm before RoPE (Qwen3, Gemma 3), the RoPE table a layer
uses (Gemma 3: a local and a global base), a sliding window, a score scale and soft-cap (Gemma)."""

from __future__ import annotations

import torch

from engine_core.attention import AttentionBackend
from engine_core.lora.batch import LoraBatch
from engine_core.models.args import ModelArgs
from engine_core.models.layers.layer_ops import TorchLayerOps
from engine_core.models.layers.rotary import RotaryEmbedding
from engine_core.models.layers.weights import Weights


class SelfAttention:
    def __init__(self, weights: Weights, prefix: str, args: ModelArgs, layer: int, rope: RotaryEmbedding,
                 gemma_norms: bool = False) -> None:
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        fused = prefix + "qkv_proj"
        self.qkv = (weights.linear(fused) if weights.has(fused + ".weight")
                    else weights.linear(*(prefix + f"{p}_proj" for p in "qkv")))
        self.o = weights.linear(prefix + "o_proj")
        self.q_norm = self.k_norm = None
        if args.qk_norm:
            self.q_norm = weights.norm(prefix + "q_norm.weight", gemma_norms)
            self.k_norm = weights.norm(prefix + "k_norm.weight", gemma_norms)
        self.rope = rope
        self.scale = (args.query_pre_attn_scalar or args.head_dim) ** -0.5
        self.window = args.window(layer)
        self.softcap = args.attn_logit_softcap or 0.0

    def __call__(self, x: torch.Tensor, ops: TorchLayerOps, attention: AttentionBackend, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, plan: object, lora: LoraBatch | None) -> torch.Tensor:
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        if lora is not None:
            lora.apply(self.layer, "qkv", x, qkv)
        qk = qkv[:, :self.q_size + self.kv_size].view(-1, heads + kv_heads, head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = ops.norm(qk[:, :heads].reshape(-1, head_dim), self.q_norm).view(-1, heads, head_dim)
            k = ops.norm(qk[:, heads:].reshape(-1, head_dim), self.k_norm).view(-1, kv_heads, head_dim)
            qk = torch.cat([q, k], dim=1)
        qk = ops.rotate(qk, self.rope)
        q, k = qk.split([heads, kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(-1, kv_heads, head_dim)
        o = attention.forward(q, k, v, k_cache, v_cache, plan, self.scale, window=self.window,
                              softcap=self.softcap).reshape(-1, self.q_size)
        out = self.o(o)
        if lora is not None:
            lora.apply(self.layer, "o", o, out)
        return out
