"""The Llama family forward (Llama 2/3, Mistral, SmolLM, Qwen2) over the paged KV cache.

Weights come straight from the HF state dict; q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from engine_core.attention import AttentionBackend, AttentionMetadata, TorchReferenceAttention
from engine_core.cpu.kernels import cpu_kernels
from engine_core.loader import ModelArgs, ModelLoadError
from engine_core.lora.batch import LoraBatch
from engine_core.models.layer_ops import FusedLayerOps, TorchLayerOps
from engine_core.models.linear import Linear, linear_kernels
from engine_core.models.rope import RotaryEmbedding


class LlamaLayer:
    def __init__(self, state: dict[str, torch.Tensor], prefix: str, args: ModelArgs, dtype: torch.dtype,
                 device: torch.device, kernels: ModuleType | None) -> None:
        def take(name: str) -> torch.Tensor:
            try:
                return state.pop(prefix + name).to(device=device, dtype=dtype)
            except KeyError:
                raise ModelLoadError(f"weight {prefix + name} missing from the checkpoint") from None

        attn = "self_attn."
        self.qkv = Linear(torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"]).contiguous(),
                          torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"]) if args.attention_bias else None,
                          kernels)
        self.o = Linear(take(attn + "o_proj.weight"), kernels=kernels)
        self.gate_up = Linear(torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")]).contiguous(),
                              kernels=kernels)
        self.down = Linear(take("mlp.down_proj.weight"), kernels=kernels)
        self.input_norm = take("input_layernorm.weight")
        self.post_attention_norm = take("post_attention_layernorm.weight")


class LlamaModel:
    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_positions: int, attention: AttentionBackend | None = None,
                 fused_ops: bool = True, device: torch.device | str = "cpu") -> None:
        self.args = args
        self.dtype = dtype
        self.device = device = torch.device(device)
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim ** -0.5
        state = dict(state)
        try:
            self.embed = state.pop("model.embed_tokens.weight").to(device=device, dtype=dtype)
            self.norm = state.pop("model.norm.weight").to(device=device, dtype=dtype)
        except KeyError as exc:
            raise ModelLoadError(f"weight {exc} missing from the checkpoint") from None
        kernels = cpu_kernels() if fused_ops and device.type == "cpu" else None
        lm_head = state.pop("lm_head.weight", None)
        tied = args.tie_word_embeddings or lm_head is None
        matmuls = linear_kernels(kernels)
        self.lm_head = Linear(self.embed if tied else lm_head.to(device=device, dtype=dtype), kernels=matmuls)
        self.layers = [LlamaLayer(state, f"model.layers.{i}.", args, dtype, device, matmuls)
                       for i in range(args.num_layers)]
        self.rope = RotaryEmbedding(args.head_dim, max_positions, args.rope_theta, args.rope_scaling, dtype, device)
        self.ops = (FusedLayerOps(self.rope, args.rms_norm_eps, kernels, dtype)
                    if FusedLayerOps.supports(kernels, dtype, args.hidden_size, args.head_dim, args.intermediate_size)
                    else TorchLayerOps(self.rope, args.rms_norm_eps))
        # the norm that follows each layer: the next layer's input norm, the final norm after the last
        self._next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        self.attention: AttentionBackend = attention or TorchReferenceAttention()
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []

    def kv_block_bytes(self, block_size: int) -> int:
        return 2 * self.args.num_layers * block_size * self.kv_size * torch.finfo(self.dtype).bits // 8

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        shape = (num_blocks, block_size, self.args.num_kv_heads, self.args.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                lora: LoraBatch | None = None) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token; `lora` adds each row's adapter delta."""
        args, ops = self.args, self.ops
        heads = args.num_heads + args.num_kv_heads
        ops.begin_step(positions)
        plan = self.attention.plan(meta, block_size=self.k_caches[0].shape[1])  # per step, not per layer
        h = F.embedding(input_ids, self.embed)  # the residual stream
        x = ops.norm(h, self.layers[0].input_norm)
        for i, (layer, k_cache, v_cache, next_norm) in enumerate(
                zip(self.layers, self.k_caches, self.v_caches, self._next_norms)):
            qkv = layer.qkv(x)
            if lora is not None:
                lora.apply(i, "qkv", x, qkv)
            qk = ops.rotate(qkv[:, :self.q_size + self.kv_size].view(-1, heads, args.head_dim))
            q, k = qk.split([args.num_heads, args.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size:].view(-1, args.num_kv_heads, args.head_dim)
            o = self.attention.forward(q, k, v, k_cache, v_cache, plan, self.scale).reshape(-1, self.q_size)
            attn_out = layer.o(o)
            if lora is not None:
                lora.apply(i, "o", o, attn_out)
            h, x = ops.add_norm(h, attn_out, layer.post_attention_norm)
            gate_up = layer.gate_up(x)
            if lora is not None:
                lora.apply(i, "gate_up", x, gate_up)
            act = ops.silu_and_mul(gate_up)
            mlp_out = layer.down(act)
            if lora is not None:
                lora.apply(i, "down", act, mlp_out)
            h, x = ops.add_norm(h, mlp_out, next_norm)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler widens them only when it needs more than the argmax."""
        return self.lm_head(hidden)
