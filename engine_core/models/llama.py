"""The Llama family forward (Llama 2/3, Mistral, SmolLM, Qwen2) over the paged KV cache.

Weights come straight from the HF state dict; q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_core.attention import AttentionMetadata, TorchReferenceAttention
from engine_core.loader import ModelArgs, ModelLoadError
from engine_core.models.linear import Linear
from engine_core.models.rope import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # one fused op; it accumulates in fp32 for bf16 input, as HF's LlamaRMSNorm does
    return F.rms_norm(x, weight.shape, weight, eps)


class LlamaLayer:
    def __init__(self, state: dict[str, torch.Tensor], prefix: str, args: ModelArgs, dtype: torch.dtype) -> None:
        def take(name: str) -> torch.Tensor:
            try:
                return state.pop(prefix + name).to(dtype)
            except KeyError:
                raise ModelLoadError(f"weight {prefix + name} missing from the checkpoint") from None

        attn = "self_attn."
        self.qkv = Linear(torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"]).contiguous(),
                          torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"]) if args.attention_bias else None)
        self.o = Linear(take(attn + "o_proj.weight"))
        self.gate_up = Linear(torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")]).contiguous())
        self.down = Linear(take("mlp.down_proj.weight"))
        self.input_norm = take("input_layernorm.weight")
        self.post_attention_norm = take("post_attention_layernorm.weight")


class LlamaModel:
    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_positions: int, attention: TorchReferenceAttention | None = None) -> None:
        self.args = args
        self.dtype = dtype
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim ** -0.5
        state = dict(state)
        try:
            self.embed = state.pop("model.embed_tokens.weight").to(dtype)
            self.norm = state.pop("model.norm.weight").to(dtype)
        except KeyError as exc:
            raise ModelLoadError(f"weight {exc} missing from the checkpoint") from None
        lm_head = state.pop("lm_head.weight", None)
        self.lm_head = Linear(self.embed if (args.tie_word_embeddings or lm_head is None) else lm_head.to(dtype))
        self.layers = [LlamaLayer(state, f"model.layers.{i}.", args, dtype) for i in range(args.num_layers)]
        self.rope = RotaryEmbedding(args.head_dim, max_positions, args.rope_theta, args.rope_scaling, dtype)
        self.attention = attention or TorchReferenceAttention()
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []

    def kv_block_bytes(self, block_size: int) -> int:
        return 2 * self.args.num_layers * block_size * self.kv_size * torch.finfo(self.dtype).bits // 8

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        shape = (num_blocks, block_size, self.args.num_kv_heads, self.args.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype) for _ in self.layers]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype) for _ in self.layers]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        args = self.args
        heads = args.num_heads + args.num_kv_heads
        h = F.embedding(input_ids, self.embed)
        rotation = self.rope.rotation(positions)  # per step, not per layer
        plan = self.attention.plan(meta, block_size=self.k_caches[0].shape[1])
        for layer, k_cache, v_cache in zip(self.layers, self.k_caches, self.v_caches):
            x = rms_norm(h, layer.input_norm, args.rms_norm_eps)
            qkv = layer.qkv(x)
            qk = self.rope.apply(qkv[:, :self.q_size + self.kv_size].view(-1, heads, args.head_dim), rotation)
            q, k = qk.split([args.num_heads, args.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size:].view(-1, args.num_kv_heads, args.head_dim)
            o = self.attention.forward(q, k, v, k_cache, v_cache, plan, self.scale)
            h = h + layer.o(o.reshape(-1, self.q_size))
            x = rms_norm(h, layer.post_attention_norm, args.rms_norm_eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return rms_norm(h, self.norm, args.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
