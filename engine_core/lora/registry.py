"""The adapters an engine serves: by name, at most `max_lora_rank` each, at most `max_loras` in a step.

Mutated only from the engine's step thread (between steps), so a step always sees one consistent set.
The concatenated weights of the last few adapter combinations are cached: in steady state the same
adapters run step after step, and rebuilding their stack each step would cost more than the delta.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from types import ModuleType

import torch

from engine_core.lora.adapter import LoraAdapter, LoraError, load_adapter
from engine_core.lora.batch import DeltaKernel, LoraBatch, Stack, build_stack
from engine_core.models.args import ModelArgs

STACK_CACHE_SIZE = 8


class LoraInUseError(LoraError):
    """Unloading an adapter that requests in flight still use: refused, nothing changes."""


class LoraRegistry:
    def __init__(self, args: ModelArgs, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device, kernels: ModuleType | None = None) -> None:
        """`kernels`: the compiled CPU kernels, whose `lora_delta_` serves decode-sized steps (fp32, bf16)."""
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
        self.args = args
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = device
        self.kernel: DeltaKernel | None = (getattr(kernels, "lora_delta_", None) if device.type == "cpu"
                                           and dtype in (torch.float32, torch.bfloat16) else None)
        self.adapters: dict[str, LoraAdapter] = {}
        self._stacks: OrderedDict[tuple[int, ...], tuple[Stack, dict[int, torch.Tensor]]] = OrderedDict()

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """Load and validate from disk (any thread: it touches nothing shared)."""
        if not name:
            raise LoraError("an adapter needs a name")
        return load_adapter(name, path, self.args, self.max_lora_rank, self.dtype, self.device)

    def add(self, adapter: LoraAdapter) -> None:
        if adapter.name in self.adapters:
            raise LoraError(f"an adapter named {adapter.name!r} is already loaded")
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> LoraAdapter:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoraError(f"no adapter named {name!r} is loaded")
        for key in [k for k in self._stacks if adapter.uid in k]:
            del self._stacks[key]
        return adapter

    def get(self, name: str) -> LoraAdapter | None:
        return self.adapters.get(name)

    def paths(self) -> dict[str, str]:
        return {name: adapter.path for name, adapter in self.adapters.items()}

    def batch(self, seq_adapters: list[LoraAdapter | None], counts: list[int]) -> LoraBatch | None:
        """The step's delta: sequence i has `counts[i]` rows, all with `seq_adapters[i]` (None: base)."""
        distinct: dict[int, LoraAdapter] = {}
        for adapter in seq_adapters:
            if adapter is not None:
                distinct.setdefault(adapter.uid, adapter)
        if not distinct:
            return None
        if len(distinct) > self.max_loras:  # the scheduler never lets this happen
            raise RuntimeError(f"{len(distinct)} adapters in one step; max_loras is {self.max_loras}")
        key = tuple(sorted(distinct))
        cached = self._stacks.get(key)
        if cached is None:
            cached = build_stack([distinct[uid] for uid in key], self.args, for_kernel=self.kernel is not None)
            self._stacks[key] = cached
            if len(self._stacks) > STACK_CACHE_SIZE:
                self._stacks.popitem(last=False)
        else:
            self._stacks.move_to_end(key)
        position = {uid: i for i, uid in enumerate(key)}
        row_owner: list[int] = []
        for adapter, n in zip(seq_adapters, counts):
            row_owner.extend([position[adapter.uid] if adapter is not None else -1] * n)
        return LoraBatch.build(cached[0], cached[1], row_owner, len(key), self.dtype, self.device, self.kernel)
