"""The LoRA delta for one step whose rows use different adapters (or none), in plain torch.

Per fused projection the step's adapters are concatenated along the rank: one shrink matmul
`s = x @ [A_1 | A_2 | ...]` for every adapted row, a 0/1 mask that keeps only each row's own
adapter's columns, and one expand `out += s @ [B_1; B_2; ...]` (B block-diagonal over q/k/v or
gate/up). Three small ops per projection whatever the mix, instead of a loop over adapters (TGI's
pure-torch path): with the ranks this engine takes, the wasted columns cost less than the extra
dispatches. Rows without an adapter are left out by an index (gathered in, added back), and a step
with no adapter at all builds no LoraBatch, so the base path does no extra work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.lora.adapter import GROUPS, LoraAdapter
from engine_core.models.linear import Linear

Pair = tuple[Linear, Linear]  # shrink, expand
# (layer, group) -> (the adapters' shrink and expand concatenated, n_sub, each adapter's own pair or None)
Stack = dict[tuple[int, str], tuple[Linear, Linear, int, list[Pair | None]]]
SEGMENT_MIN_ROWS = 256  # from this many adapted rows with 2+ adapters, one exact pass per adapter beats the mask


def build_stack(adapters: list[LoraAdapter], num_layers: int) -> tuple[Stack, dict[int, torch.Tensor]]:
    """The concatenated weights of a set of adapters, and for each sub-module count the owner (position
    in `adapters`) of every rank column. An adapter that lacks a group another one has adds zeros."""
    stack: Stack = {}
    for layer in range(num_layers):
        for group, modules in GROUPS.items():
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
            stack[(layer, group)] = (Linear(torch.cat(parts_a, dim=1).t().contiguous()),
                                     Linear(torch.cat(parts_b, dim=0).t().contiguous()), n_sub, singles)
    device = next(iter(adapters[0].weights.values()))[0].device
    owners = {n: torch.cat([torch.full((n * ad.rank,), i, dtype=torch.long) for i, ad in enumerate(adapters)])
              .to(device) for n in {len(m) for m in GROUPS.values()}}
    return stack, owners


@dataclass(slots=True)
class LoraBatch:
    stack: Stack
    rows: torch.Tensor | None  # the adapted rows, or None when every row has an adapter
    masks: dict[int, torch.Tensor | None]  # by sub-module count; None: one adapter, nothing to mask
    # a big (prefill) step with several adapters: each adapter's rows, for one exact pass per adapter, where
    # the mask would multiply every row by every adapter; there the op count matters less than the flops
    segments: list[tuple[int, torch.Tensor]] | None = None

    @classmethod
    def build(cls, stack: Stack, owners: dict[int, torch.Tensor], row_owner: list[int], num_adapters: int,
              dtype: torch.dtype, device: torch.device) -> LoraBatch:
        """`row_owner[t]`: the position of row t's adapter in the stack, -1 for none."""
        adapted = [t for t, o in enumerate(row_owner) if o >= 0]
        rows = None if len(adapted) == len(row_owner) else torch.tensor(adapted, dtype=torch.long).to(device)
        masks: dict[int, torch.Tensor | None] = dict.fromkeys(owners)
        if num_adapters > 1 and len(adapted) >= SEGMENT_MIN_ROWS:
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
        shrink, expand, n_sub, singles = entry
        if self.segments is not None:
            for owner, rows in self.segments:
                pair = singles[owner]
                if pair is not None:
                    out.index_add_(0, rows, pair[1](pair[0](x.index_select(0, rows))))
            return
        s = shrink(x if self.rows is None else x.index_select(0, self.rows))
        mask = self.masks[n_sub]
        if mask is not None:
            s.mul_(mask)
        if self.rows is None:
            out.add_(expand(s))
        else:
            out.index_add_(0, self.rows, expand(s))
