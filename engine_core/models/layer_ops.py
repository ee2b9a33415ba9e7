"""The per-layer glue of the forward, RMSNorm with the residual add and rotary embeddings, in two
interchangeable forms: torch ops (any dtype, any CPU) and the compiled fused ops
(`engine_core/cpu/csrc/layer_ops.cpp` for bf16 on AVX-512 BF16, `layer_ops_f32.cpp` for fp32 on any CPU),
which do in one call each what takes torch a dozen dispatches: at batch 1 those dispatches cost more
than the math.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from engine_core.models.rope import RotaryEmbedding


class TorchLayerOps:
    def __init__(self, rope: RotaryEmbedding, eps: float) -> None:
        self.rope = rope
        self.eps = eps
        self._rotation: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin_step(self, positions: torch.Tensor) -> None:
        self._rotation = self.rope.rotation(positions)  # per step, not per layer

    def norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # one fused op; it accumulates in fp32 for bf16 input, as HF's LlamaRMSNorm does
        return F.rms_norm(h, weight.shape, weight, self.eps)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after adding delta, and its norm."""
        h = h + delta
        return h, self.norm(h, weight)

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        """Rotary embeddings on [T, H, D] queries and keys (a view into the qkv projection)."""
        assert self._rotation is not None
        return self.rope.apply(qk, self._rotation)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, from the fused [T, 2I] gate|up projection."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedLayerOps(TorchLayerOps):
    # the kernels' names per dtype: (rms_norm, rotary in place, silu_and_mul)
    KERNELS = {torch.bfloat16: ("rms_norm", "rotary_", "silu_and_mul"),
               torch.float32: ("rms_norm_f32", "rotary_f32_", "silu_and_mul_f32")}

    def __init__(self, rope: RotaryEmbedding, eps: float, kernels: ModuleType, dtype: torch.dtype) -> None:
        super().__init__(rope, eps)
        self._rms_norm, self._rotary, self._silu_and_mul = (getattr(kernels, n) for n in self.KERNELS[dtype])
        self._positions: torch.Tensor | None = None

    @classmethod
    def supports(cls, kernels: ModuleType | None, dtype: torch.dtype, hidden_size: int, head_dim: int,
                 intermediate_size: int) -> bool:
        names = cls.KERNELS.get(dtype)
        if kernels is None or names is None or not all(hasattr(kernels, n) for n in names):
            return False
        # the bf16 kernels work in vectors of 16 (and rotary in halves of a head); the fp32 ones in any width
        return dtype != torch.bfloat16 or (hidden_size % 16 == 0 and head_dim % 32 == 0 and intermediate_size % 16 == 0)

    def begin_step(self, positions: torch.Tensor) -> None:
        self._positions = positions

    def norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(h, None, weight, self.eps)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h, self._rms_norm(h, delta, weight, self.eps)  # h += delta in place

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        self._rotary(qk, self._positions, self.rope.cos, self.rope.sin)  # in place; it signs sin itself
        return qk

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(gate_up)
