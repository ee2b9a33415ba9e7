"""The per-layer glue of the forward, RMSNorm with the residual add and rotary embeddings, in two
interchangeable forms: torch ops (any dtype, any CPU; the fp32 path checked token for token against
transformers) and the compiled fused ops for bf16 (`engine_core/csrc/layer_ops.cpp`), which do in one
call each what takes torch a dozen dispatches: at batch 1 those dispatches cost more than the math.
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
    def __init__(self, rope: RotaryEmbedding, eps: float, kernels: ModuleType) -> None:
        super().__init__(rope, eps)
        self.kernels = kernels
        self._positions: torch.Tensor | None = None

    @staticmethod
    def supports(kernels: ModuleType | None, dtype: torch.dtype, hidden_size: int, head_dim: int,
                 intermediate_size: int) -> bool:
        return (kernels is not None and hasattr(kernels, "rms_norm") and dtype == torch.bfloat16
                and hidden_size % 16 == 0 and head_dim % 32 == 0 and intermediate_size % 16 == 0)

    def begin_step(self, positions: torch.Tensor) -> None:
        self._positions = positions

    def norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(h, None, weight, self.eps)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h, self.kernels.rms_norm(h, delta, weight, self.eps)  # h += delta in place

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        self.kernels.rotary_(qk, self._positions, self.rope.cos, self.rope.sin)  # in place; it signs sin itself
        return qk

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(gate_up)
