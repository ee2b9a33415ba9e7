"""The gated MLP every dense family uses: down(act(gate x) * up x), one matmul for gate|up. The activation
is SiLU (SwiGLU: Llama, Qwen, Phi, Mistral) or tanh-approximated GELU (GeGLU: Gemma)."""

from __future__ import annotations

import torch

from engine_core.lora.batch import LoraBatch
from engine_core.models.layers.layer_ops import TorchLayerOps
from engine_core.models.layers.weights import Weights

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class GatedMLP:
    def __init__(self, weights: Weights, prefix: str, layer: int, activation: str = "silu") -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}")
        self.layer = layer
        fused = prefix + "gate_up_proj"  # Phi-3 checkpoints store it fused
        self.gate_up = (weights.linear(fused) if weights.has(fused + ".weight")
                        else weights.linear(prefix + "gate_proj", prefix + "up_proj"))
        self.down = weights.linear(prefix + "down_proj")
        self.gelu = activation == "gelu_pytorch_tanh"

    def __call__(self, x: torch.Tensor, ops: TorchLayerOps, lora: LoraBatch | None) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if lora is not None:
            lora.apply(self.layer, "gate_up", x, gate_up)
        act = ops.gelu_tanh_and_mul(gate_up) if self.gelu else ops.silu_and_mul(gate_up)
        out = self.down(act)
        if lora is not None:
            lora.apply(self.layer, "down", act, out)
        return out
