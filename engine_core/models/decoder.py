"""The decoder-only forward every family shares, over the paged KV cache: embed, the layers, the final norm,
the LM head. A family file supplies its layer (what runs between two residual adds) and its switches: the
embedding scale, Gemma's (1 + w) norms, a final-logit soft-cap.

A layer takes the residual stream h and its normed copy x, and returns both for the next layer, whose input
norm it applies itself (`next_norm`): that norm and the residual add are one fused op on CPU.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engine_core.attention import AttentionBackend, AttentionMetadata, TorchReferenceAttention
from engine_core.cpu.kernels import cpu_kernels
from engine_core.lora.batch import LoraBatch
from engine_core.models.args import ModelArgs
from engine_core.models.layers.decoder_stack import build_decoder_stack, stack_serves
from engine_core.models.layers.layer_ops import FusedLayerOps, TorchLayerOps
from engine_core.models.layers.linear import rounding_allowed
from engine_core.models.layers.quant import QuantizedTensor
from engine_core.models.layers.rotary import RotaryEmbedding
from engine_core.models.layers.weights import Weights


class DecoderLayer(Protocol):
    input_norm: torch.Tensor

    def __call__(self, h: torch.Tensor, x: torch.Tensor, next_norm: torch.Tensor, ops: TorchLayerOps,
                 attention: AttentionBackend, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: object,
                 lora: LoraBatch | None) -> tuple[torch.Tensor, torch.Tensor]: ...


class DecoderModel:
    gemma_norms = False  # RMSNorm weights as (1 + w), in fp32
    scale_embeddings = False  # h0 = E[ids] * sqrt(hidden), the scale rounded to the weights' dtype

    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_positions: int, attention: AttentionBackend | None = None,
                 fused_ops: bool = True, device: torch.device | str = "cpu", quantization: str = "auto") -> None:
        self.args = args
        self.dtype = dtype
        self.device = device = torch.device(device)
        self.max_positions = max_positions
        self.kv_size = args.num_kv_heads * args.head_dim
        kernels = cpu_kernels() if fused_ops and device.type == "cpu" else None
        weights = Weights(state, dtype, device, kernels, quantization)
        # the table and a tied head are one tensor: quantized, a step reads it once, for the logits
        self.embed = weights.take_matrix("model.embed_tokens.weight", vocab=True)
        self.embed_scale = torch.tensor(args.hidden_size ** 0.5, dtype=dtype) if self.scale_embeddings else None
        self.norm = weights.norm("model.norm.weight", self.gemma_norms)
        lm_head = weights.take_matrix("lm_head.weight", vocab=True) if weights.has("lm_head.weight") else None
        tied = args.tie_word_embeddings or lm_head is None
        self.lm_head = weights.linear_of([self.embed if tied else lm_head], fp32_out=True)  # type: ignore[list-item]
        self.layers: list[DecoderLayer] = [self.build_layer(weights, f"model.layers.{i}.", i)
                                           for i in range(args.num_layers)]
        weights.finish()
        self.linear_paths = dict(weights.layers)
        self.ops = (FusedLayerOps(args.rms_norm_eps, kernels, dtype)
                    if FusedLayerOps.supports(kernels, dtype, args.hidden_size, args.head_dim, args.intermediate_size)
                    else TorchLayerOps(args.rms_norm_eps))
        # the norm that follows each layer: the next layer's input norm, the final norm after the last
        self._next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        self.attention: AttentionBackend = attention or TorchReferenceAttention()
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.stack = build_decoder_stack(self, kernels)  # the layers in one compiled call, where it runs them

    def build_layer(self, weights: Weights, prefix: str, index: int) -> DecoderLayer:
        raise NotImplementedError

    def rope(self, theta: float | None = None, scaling: dict | None = None) -> RotaryEmbedding:
        """A rotary table for this model's heads (the model's base and scaling unless given)."""
        args = self.args
        return RotaryEmbedding(args.head_dim, self.max_positions, theta or args.rope_theta,
                               args.rope_scaling if theta is None else scaling, self.dtype, self.device,
                               rotary_dim=args.rotary_dim)

    def kv_block_bytes(self, block_size: int) -> int:
        return 2 * self.args.num_layers * block_size * self.kv_size * torch.finfo(self.dtype).bits // 8

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        shape = (num_blocks, block_size, self.args.num_kv_heads, self.args.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                lora: LoraBatch | None = None, exact: bool = True) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token; `lora` adds each row's adapter delta.
        `exact`: the step holds a speculative verify pass, whose rows must each get what a 1-row step gets; a step
        without one may run larger quantized matmuls as a prefill does (ROUNDED_MIN_ROWS)."""
        ops = self.ops
        ops.begin_step(positions)
        plan = self.attention.plan(meta, block_size=self.k_caches[0].shape[1])  # per step, not per layer
        # the residual stream
        if isinstance(self.embed, QuantizedTensor):
            h = self.embed.embedding(input_ids, self.dtype)
        else:
            h = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        x = ops.norm(h, self.layers[0].input_norm)
        if stack_serves(self.stack, input_ids.numel(), plan, lora):
            return self.stack.forward(h, x, positions, self.k_caches, self.v_caches, plan.blocks, plan.key_counts,
                                      meta.slot_mapping, exact)[1]
        with rounding_allowed(not exact):
            for layer, k_cache, v_cache, next_norm in zip(self.layers, self.k_caches, self.v_caches,
                                                          self._next_norms):
                h, x = layer(h, x, next_norm, ops, self.attention, k_cache, v_cache, plan, lora)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, exact: bool = True) -> torch.Tensor:
        """In fp32 in every dtype: the LM head keeps its fp32 sums (bf16 would round logits near 16 to multiples
        of 0.125, and greedy decoding would choose between false ties). `exact` as for `forward`: a step without a
        verify pass may round a quantized head's weights to bf16 from ROUNDED_MIN_ROWS rows, as its layers do."""
        with rounding_allowed(not exact):
            logits = self.lm_head(hidden)
        cap = self.args.final_logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap
