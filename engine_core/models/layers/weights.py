"""Taking a checkpoint's tensors by name into the engine's layout (fused q|k|v and gate|up matmuls), with a
clear error for a missing weight and, at the end, for any weight the forward would not use: a checkpoint
with a tensor the family does not know (a bias, an extra norm) is refused, never served without it."""

from __future__ import annotations

from types import ModuleType

import torch

from engine_core.models.args import ModelLoadError
from engine_core.models.layers.linear import Linear


class Weights:
    def __init__(self, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 kernels: ModuleType | None) -> None:
        self.state = dict(state)
        self.dtype = dtype
        self.device = device
        self.kernels = kernels  # for the linear layers' packed paths

    def has(self, name: str) -> bool:
        return name in self.state

    def take(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        try:
            tensor = self.state.pop(name)
        except KeyError:
            raise ModelLoadError(f"weight {name} missing from the checkpoint") from None
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self.state else None

    def linear(self, *names: str) -> Linear:
        """One matmul over the named projections' weights stacked by output (q|k|v, gate|up), with their
        biases where the checkpoint has them (all or none)."""
        weight = torch.cat([self.take(n + ".weight") for n in names]).contiguous()
        biases = [self.maybe(n + ".bias") for n in names]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            raise ModelLoadError(f"some of {', '.join(names)} have a bias and some do not")
        bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        return Linear(weight, bias, self.kernels)

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
