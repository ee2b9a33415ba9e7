"""Taking a checkpoint's tensors by name into the engine's layout (fused q|k|v and gate|up matmuls), with a
clear error for a missing weight and, at the end, for any weight the forward would not use: a checkpoint
with a tensor the family does not know (a bias, an extra norm) is refused, never served without it.

Every linear layer is made here (`linear_of`), which is where the quantization is applied: "int8" / "int4"
quantize each matmul's weight (the LM head and the embedding table too) once at load; a tensor the loader
kept quantized (a GGUF's blocks, `quant.QuantizedTensor`) is served in its format; "none" and "auto" keep a
plain checkpoint's weights in the dtype."""

from __future__ import annotations

from collections import Counter
from types import ModuleType

import torch

from engine_core.models.args import ModelLoadError
from engine_core.models.layers.linear import Linear, QuantLinear, linear_kernels
from engine_core.models.layers.quant import QUANTIZATIONS, QuantizedTensor, quantizable, quantize

Tensor = torch.Tensor | QuantizedTensor


class Weights:
    def __init__(self, state: dict[str, Tensor], dtype: torch.dtype, device: torch.device,
                 kernels: ModuleType | None, quantization: str = "auto") -> None:
        if quantization not in QUANTIZATIONS:
            raise ModelLoadError(f"quantization {quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
        self.state = dict(state)
        self.dtype = dtype
        self.device = device
        self.kernels = kernels  # the compiled CPU kernels, or None
        self.quantization = quantization
        self.layers: Counter[str] = Counter()  # how many linear layers run on each path, for the start log

    def has(self, name: str) -> bool:
        return name in self.state

    def take(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A plain tensor in the dtype (a quantized one dequantized: norms and biases are never kept so)."""
        tensor = self.take_matrix(name)
        if isinstance(tensor, QuantizedTensor):
            return tensor.dequantize(dtype or self.dtype)
        return tensor.to(dtype=dtype or self.dtype)

    def take_matrix(self, name: str, vocab: bool = False) -> Tensor:
        """A matmul's weight or the embedding table: quantized where the loader kept it so, or made so here
        ("int8"/"int4"), else in the dtype. `vocab`: the embedding table or the LM head, which "int4" makes int8,
        as llama.cpp's 4-bit mixes keep them at 6-8 bits: in 4 bits they alone raised SmolLM2's perplexity by
        10% (its layers, dequantized from Q4_1, come back exactly)."""
        try:
            tensor = self.state.pop(name)
        except KeyError:
            raise ModelLoadError(f"weight {name} missing from the checkpoint") from None
        return self.matrix(tensor, "int8" if vocab and self.quantization == "int4" else None)

    def matrix(self, tensor: Tensor, scheme: str | None = None) -> Tensor:
        if isinstance(tensor, QuantizedTensor):
            return tensor.to(self.device)
        if self.quantization in ("int8", "int4") and quantizable(tensor):
            return quantize(tensor, scheme or self.quantization).to(self.device)
        return tensor.to(device=self.device, dtype=self.dtype)

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self.state else None

    def linear(self, *names: str) -> Linear | QuantLinear:
        """One matmul over the named projections' weights stacked by output (q|k|v, gate|up), with their
        biases where the checkpoint has them (all or none)."""
        parts = [self.take_matrix(n + ".weight") for n in names]
        biases = [self.maybe(n + ".bias") for n in names]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            raise ModelLoadError(f"some of {', '.join(names)} have a bias and some do not")
        bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        return self.linear_of(parts, bias)

    def linear_of(self, parts: list[Tensor], bias: torch.Tensor | None = None,
                  fp32_out: bool = False) -> Linear | QuantLinear:
        """The layer for these weights stacked by output; `fp32_out` for the LM head's logits."""
        layer: Linear | QuantLinear
        if all(isinstance(p, QuantizedTensor) for p in parts):
            layer = QuantLinear(parts, bias, self.kernels, self.dtype, fp32_out)  # type: ignore[arg-type]
        else:  # a fused projection with a part in a format without a kernel (a GGUF's F16 v beside Q4 q, k)
            plain = [p.dequantize(self.dtype) if isinstance(p, QuantizedTensor) else p for p in parts]
            weight = torch.cat(plain).contiguous()  # type: ignore[arg-type]
            layer = Linear(weight, bias, self.kernels if fp32_out else linear_kernels(self.kernels), fp32_out)
        self.layers[layer.path + (" (LM head, fp32 logits)" if fp32_out else "")] += 1
        return layer

    def norm(self, name: str, offset: bool) -> torch.Tensor:
        """A norm's weight; Gemma's (1 + w) form is kept as 1 + w in fp32, the precision its product runs in."""
        if offset:
            return 1.0 + self.take(name, torch.float32)
        return self.take(name)

    def finish(self, ignored: tuple[str, ...] = ("rotary_emb.inv_freq",)) -> None:
        left = sorted(n for n in self.state if not n.endswith(ignored))
        if left:
            shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
            raise ModelLoadError(f"the checkpoint has weights this model family does not use: {shown}")
