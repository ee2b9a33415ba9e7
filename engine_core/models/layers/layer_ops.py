"""The per-layer glue of the forward, RMSNorm with the residual add, rotary embeddings and the gated
activations, in two interchangeable forms: torch ops (any dtype, any CPU) and the compiled fused ops
(`engine_core/cpu/csrc/layer_ops.cpp` for bf16 on AVX-512 BF16, `layer_ops_f32.cpp` for fp32 on any CPU),
which do in one call each what takes torch a dozen dispatches: at batch 1 those dispatches cost more
than the math.

A norm whose weight is float32 under a bf16 model is Gemma's: its (1 + w) weight is kept in fp32 and the
whole product is computed in fp32 before the one cast back, as transformers' Gemma RMSNorm does.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from engine_core.models.layers.rotary import RotaryEmbedding


class TorchLayerOps:
    def __init__(self, eps: float) -> None:
        self.eps = eps
        self._positions: torch.Tensor | None = None
        self._rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin_step(self, positions: torch.Tensor) -> None:
        self._positions = positions
        self._rotations = {}  # each rotary table's cos/sin rows, gathered once per step, not per layer

    def norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype != h.dtype:  # Gemma's fp32 (1 + w) under bf16 activations
            return F.rms_norm(h.float(), weight.shape, weight, self.eps).to(h.dtype)
        # one fused op; it accumulates in fp32 for bf16 input, as HF's LlamaRMSNorm does
        return F.rms_norm(h, weight.shape, weight, self.eps)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after adding delta, and its norm."""
        h = h + delta
        return h, self.norm(h, weight)

    def rotate(self, qk: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        """Rotary embeddings on [T, H, D] queries and keys (a view into the qkv projection)."""
        assert self._positions is not None
        rotation = self._rotations.get(id(rope))
        if rotation is None:
            rotation = self._rotations[id(rope)] = rope.rotation(self._positions)
        return rope.apply(qk, rotation)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, from the fused [T, 2I] gate|up projection."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up (Gemma's GeGLU)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class FusedLayerOps(TorchLayerOps):
    # the kernels' names per dtype: (rms_norm, rotary in place, silu_and_mul, gelu_tanh_and_mul)
    KERNELS = {torch.bfloat16: ("rms_norm", "rotary_", "silu_and_mul", "gelu_tanh_and_mul"),
               torch.float32: ("rms_norm_f32", "rotary_f32_", "silu_and_mul_f32", "gelu_tanh_and_mul_f32")}

    def __init__(self, eps: float, kernels: ModuleType, dtype: torch.dtype) -> None:
        super().__init__(eps)
        self._rms_norm, self._rotary, self._silu_and_mul, self._gelu_tanh_and_mul = (
            getattr(kernels, n) for n in self.KERNELS[dtype])

    @classmethod
    def supports(cls, kernels: ModuleType | None, dtype: torch.dtype, hidden_size: int, head_dim: int,
                 intermediate_size: int) -> bool:
        names = cls.KERNELS.get(dtype)
        if kernels is None or names is None or not all(hasattr(kernels, n) for n in names):
            return False
        # the bf16 kernels work in vectors of 16 (and rotary in halves of a head); the fp32 ones in any width
        return dtype != torch.bfloat16 or (hidden_size % 16 == 0 and head_dim % 32 == 0 and intermediate_size % 16 == 0)

    # the bf16 kernel takes Gemma's fp32 weights too, and computes their product in fp32 as transformers does
    def norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(h.contiguous(), None, weight, self.eps)  # q/k-norm passes strided head views

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h, self._rms_norm(h, delta, weight, self.eps)  # h += delta in place

    def rotate(self, qk: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        if rope.rotary_dim != qk.shape[-1]:  # partial rotary (Phi): the kernel turns whole heads only
            return super().rotate(qk, rope)
        self._rotary(qk, self._positions, rope.cos, rope.sin)  # in place; it signs sin itself
        return qk

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._gelu_tanh_and_mul(gate_up)
