"""The LoRA delta for one step whose rows use different adapters (or none).

Three ways, by step size, all exact:
- **The compiled kernel** (`engine_core/cpu/csrc/lora_delta.cpp`, CPU, fp32 or bf16) for decode-sized steps:
  one call per projection, each row reading only its own adapter's A and B (punica's BGMV). The torch
  ways below cost 3-4 small oneDNN calls per projection, ~30 µs of fixed cost each, and the mask's flops.
- **The mask** where the kernel is not available: the step's adapters concatenated along the rank, one
  shrink `s = x @ [A_1 | A_2 | ...]`, a 0/1 mask keeping each row's own adapter's columns, one expand
  `out += s @ [B_1; B_2; ...]` (B block-diagonal over q/k/v or gate/up).
- **One pass per adapter** for big (prefill) steps with several adapters: there the mask would multiply
  every row by every adapter, and oneDNN's matmuls beat the kernel once their fixed cost is amortized.
A step with no adapter at all builds no LoraBatch, so the base path does no extra work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_core.lora.adapter import LoraAdapter, groups, module_shapes
from engine_core.models.args import ModelArgs
from engine_core.models.layers.linear import Linear

Pair = tuple[Linear, Linear]  # shrink, expand
# the compiled kernel: lora_delta_(out, x, a, b, slots, rank, bounds)
DeltaKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, list[int]], None]
BIG_STEP_ROWS = 256  # from this many adapted rows, oneDNN passes (one per adapter when several) beat the rest


@dataclass(slots=True)
class GroupStack:
    """One fused projection (q/k/v, o, gate/up or down) of one layer, for the adapters of a stack."""

    shrink: Linear  # the adapters' A concatenated along the rank
    expand: Linear  # their B stacked
    n_sub: int
    singles: list[Pair | None]  # each adapter's own pair; None: it does not adapt this projection
    # for the kernel: per adapter (slot), each sub-module's A rows [S, n_sub * rank, in] and B rows
    # [S, n_sub * rank, out], every adapter padded with zeros to the stack's largest rank
    slot_a: torch.Tensor | None = None
    slot_b: torch.Tensor | None = None
    rank: int = 0
    bounds: list[int] | None = None  # the sub-modules' output columns: [0, q, q + k, q + k + v]


Stack = dict[tuple[int, str], GroupStack]  # by (layer, group)


def _slot_layout(adapters: list[LoraAdapter], key: tuple[int, str], fan_in: int, outs: list[int],
                 like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    n_sub, rank = len(outs), max(ad.rank for ad in adapters)
    slot_a = like.new_zeros(len(adapters), n_sub * rank, fan_in)
    slot_b = like.new_zeros(len(adapters), n_sub * rank, sum(outs))
    for slot, ad in enumerate(adapters):
        entry = ad.weights.get(key)
        if entry is None:
            continue
        a, b = entry
        for k in range(n_sub):
            own = slice(k * ad.rank, (k + 1) * ad.rank)
            slot_a[slot, k * rank:k * rank + ad.rank] = a[:, own].t()
            slot_b[slot, k * rank:k * rank + ad.rank] = b[own]
    return slot_a.contiguous(), slot_b.contiguous(), rank


def build_stack(adapters: list[LoraAdapter], args: ModelArgs, for_kernel: bool
                ) -> tuple[Stack, dict[int, torch.Tensor]]:
    """The concatenated weights of a set of adapters, and for each sub-module count the owner (position
    in `adapters`) of every rank column. An adapter that lacks a group another one has adds zeros."""
    shapes = module_shapes(args)
    model_groups = groups(args)
    stack: Stack = {}
    for layer in range(args.num_layers):
        for group, modules in model_groups.items():
            entries = [ad.weights.get((layer, group)) for ad in adapters]
            if all(e is None for e in entries):
                continue
            like = next(e for e in entries if e is not None)
            n_sub = len(modules)
            parts_a, parts_b = [], []
            singles: list[Pair | None] = [None if e is None else (Linear(e[0].t().contiguous()),
                                                                  Linear(e[1].t().contiguous())) for e in entries]
            for ad, entry in zip(adapters, entries):
                if entry is None:
                    entry = (like[0].new_zeros(like[0].shape[0], n_sub * ad.rank),
                             like[1].new_zeros(n_sub * ad.rank, like[1].shape[1]))
                parts_a.append(entry[0])
                parts_b.append(entry[1])
            # as Linear layers: for bf16 on CPU their weights are pre-packed for oneDNN, which multiplies these
            # skinny shapes faster than a plain matmul
            entry = GroupStack(Linear(torch.cat(parts_a, dim=1).t().contiguous()),
                               Linear(torch.cat(parts_b, dim=0).t().contiguous()), n_sub, singles)
            if for_kernel:
                outs = [shapes[m][1] for m in modules]
                entry.slot_a, entry.slot_b, entry.rank = _slot_layout(adapters, (layer, group), shapes[modules[0]][0],
                                                                      outs, like[0])
                entry.bounds = [sum(outs[:k]) for k in range(n_sub + 1)]
            stack[(layer, group)] = entry
    device = next(iter(adapters[0].weights.values()))[0].device
    owners = {n: torch.cat([torch.full((n * ad.rank,), i, dtype=torch.long) for i, ad in enumerate(adapters)])
              .to(device) for n in {len(m) for m in model_groups.values()}}
    return stack, owners


@dataclass(slots=True)
class LoraBatch:
    stack: Stack
    rows: torch.Tensor | None  # the adapted rows, or None when every row has an adapter
    masks: dict[int, torch.Tensor | None]  # by sub-module count; None: one adapter, nothing to mask
    # a big (prefill) step with several adapters: each adapter's rows, for one exact pass per adapter
    segments: list[tuple[int, torch.Tensor]] | None = None
    # the kernel's way: every row's slot (-1: no adapter)
    kernel: DeltaKernel | None = None
    slots: torch.Tensor | None = None

    @classmethod
    def build(cls, stack: Stack, owners: dict[int, torch.Tensor], row_owner: list[int], num_adapters: int,
              dtype: torch.dtype, device: torch.device, kernel: DeltaKernel | None = None) -> LoraBatch:
        """`row_owner[t]`: the position of row t's adapter in the stack, -1 for none. `kernel` is used when
        given (the stack was built for it) and the step is small enough."""
        adapted = [t for t, o in enumerate(row_owner) if o >= 0]
        masks: dict[int, torch.Tensor | None] = dict.fromkeys(owners)
        if kernel is not None and len(adapted) < BIG_STEP_ROWS:
            return cls(stack, None, masks, kernel=kernel, slots=torch.tensor(row_owner, dtype=torch.long))
        rows = None if len(adapted) == len(row_owner) else torch.tensor(adapted, dtype=torch.long).to(device)
        if num_adapters > 1 and len(adapted) >= BIG_STEP_ROWS:
            by_owner: dict[int, list[int]] = {}
            for t in adapted:
                by_owner.setdefault(row_owner[t], []).append(t)
            segments = [(o, torch.tensor(ts, dtype=torch.long).to(device)) for o, ts in by_owner.items()]
            return cls(stack, rows, masks, segments)
        if num_adapters > 1:
            owner = torch.tensor([row_owner[t] for t in adapted], dtype=torch.long).to(device)
            masks = {n: (owner[:, None] == cols[None, :]).to(dtype) for n, cols in owners.items()}
        return cls(stack, rows, masks)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += the delta of each row's adapter for x; in place."""
        entry = self.stack.get((layer, group))
        if entry is None:
            return
        if self.kernel is not None:
            assert self.slots is not None and entry.slot_a is not None and entry.bounds is not None
            self.kernel(out, x.contiguous(), entry.slot_a, entry.slot_b, self.slots, entry.rank, entry.bounds)
            return
        if self.segments is not None:
            for owner, rows in self.segments:
                pair = entry.singles[owner]
                if pair is not None:
                    out.index_add_(0, rows, pair[1](pair[0](x.index_select(0, rows))))
            return
        s = entry.shrink(x if self.rows is None else x.index_select(0, self.rows))
        mask = self.masks[entry.n_sub]
        if mask is not None:
            s.mul_(mask)
        if self.rows is None:
            out.add_(entry.expand(s))
        else:
            out.index_add_(0, self.rows, entry.expand(s))
