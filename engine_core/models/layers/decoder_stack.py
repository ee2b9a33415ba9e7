"""The compiled decoder stack: a Llama-shaped model's layers run in one kernel call for small fp32 or bf16 steps.

At batch 1 each layer makes about nine kernel calls and a dozen tensor views from Python, ~2 us each: on
SmolLM2-135M (30 layers) that glue is about 1.3 ms of a 10 ms step on an AVX2 CPU. `DecoderStack`
(`engine_core/cpu/csrc/decoder_stack.cpp`) makes the same calls on the same tensors in C++, so its output is
the Python layers' to the bit (tests/test_decoder_stack.py). It serves what it was written for and nothing else:
fp32 activations with the fused fp32 ops, or bf16 ones with the fused bf16 ops (an AVX-512 BF16 build), the
compiled paged attention, whole-head rotary, Llama's layer (Llama, SmolLM, Mistral, Qwen2/3), every matmul on
linear_quant, a plain fp32 weight or a bf16 one packed for linear_bf16, steps of at most QUANT_KERNEL_MAX_ROWS rows
and no LoRA adapter in the step. Any other model or step takes the Python layers.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from engine_core.attention.cpu_paged import CpuPagedAttention, RowPlan
from engine_core.models.layers.layer_ops import FusedLayerOps
from engine_core.models.layers.linear import QUANT_KERNEL_MAX_ROWS, ROUNDED_MIN_ROWS, Linear, QuantLinear
from engine_core.models.layers.mlp import GatedMLP


def _projection(kernels: ModuleType, layer: Linear | QuantLinear, dtype: torch.dtype) -> Any | None:
    projection = kernels.StackProjection(layer.out_features)
    if isinstance(layer, QuantLinear):
        if layer.kernel is None or layer.dtype != dtype:
            return None
        for col0, codes, scales, mins, bits, group, bias in layer.part_args:
            projection.add_quant_part(col0, codes, scales, mins, bits, group, bias)
        if layer.rows_kernel is not None and dtype == torch.bfloat16:  # what a prefill of bf16 rows runs
            projection.set_rounded_min_rows(ROUNDED_MIN_ROWS)
        return projection
    if layer.fp32_out:
        return None
    if dtype == torch.bfloat16 and layer.path == "linear_bf16":
        projection.set_packed(layer.blocks, layer.bias)
        projection.set_rounded_min_rows(ROUNDED_MIN_ROWS)  # Linear's rule for its prefill tiles, to the bit
        return projection
    if dtype != torch.float32 or layer.path != "torch" or layer.weight is None or layer.weight.dtype != dtype:
        return None
    projection.set_dense(layer.weight, layer.bias)
    return projection


def build_decoder_stack(model: Any, kernels: ModuleType | None) -> Any | None:
    """The model's layers as one DecoderStack, or None where any part of them is not what the stack runs."""
    from engine_core.models.llama import LlamaLayer  # the family file imports the shared layers, not back

    args = model.args
    dtype = model.dtype
    if (kernels is None or not hasattr(kernels, "DecoderStack") or dtype not in (torch.float32, torch.bfloat16)
            or not isinstance(model.ops, FusedLayerOps) or not isinstance(model.attention, CpuPagedAttention)
            or not all(type(layer) is LlamaLayer for layer in model.layers)):
        return None
    first: GatedMLP = model.layers[0].mlp
    stack = kernels.DecoderStack(args.num_heads, args.num_kv_heads, args.head_dim, args.rms_norm_eps, first.gelu,
                                 dtype == torch.bfloat16)
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        projections = [_projection(kernels, p, dtype) for p in (attn.qkv, attn.o, mlp.gate_up, mlp.down)]
        if (any(p is None for p in projections) or mlp.gelu != first.gelu or attn.rope.rotary_dim != args.head_dim
                or attn.rope.cos.dtype != dtype):
            return None
        stack.add_layer(layer.input_norm, layer.post_attention_norm, *projections, attn.q_norm, attn.k_norm,
                        attn.rope.cos, attn.rope.sin, attn.scale, attn.window, attn.softcap)
    stack.set_final_norm(model.norm)
    return stack


def stack_serves(stack: Any | None, rows: int, plan: object, lora: object) -> bool:
    """Whether this step runs on the stack: small, no adapter, the compiled attention's plan."""
    return stack is not None and rows <= QUANT_KERNEL_MAX_ROWS and lora is None and isinstance(plan, RowPlan)
