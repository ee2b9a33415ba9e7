"""Attention for CPU that reads keys and values in place from the paged cache, with one compiled kernel
call per layer for every row of the step, prefill or decode.

The torch reference gathers every decoding sequence's blocks into a padded [B, Hkv, L, D] copy, then
transposes (another copy) for its matmuls: at batch 128 that was about 60% of a decode step (profile
in docs/benchmarks.md), and it runs each prefill chunk as its own SDPA call. The compiled kernel
(`engine_core/cpu/csrc/paged_decode.cpp`, built by `engine_core.cpu.kernels`) walks a block table in place,
scores and softmax in fp32, one query per row. A prefill token is such a row too: once this step's keys
and values are in the cache, causal attention for the token at position p is attention over the first
p + 1 slots of its sequence's blocks. So the plan gives every row its sequence's block table and its own
key count, and mixed batches, chunks over a cached prefix and decodes all go through the one call. The
layer's sliding window W and soft-cap go to the kernel as they are: a row then reads only its last W keys,
from max(0, key_count - W), so the plan stays the same for every layer of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_core.attention.metadata import AttentionMetadata
from engine_core.cpu.kernels import cpu_kernels


def paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """The compiled kernel, or None when it cannot be built here."""
    module = cpu_kernels()
    return None if module is None else module.paged_decode


@dataclass(slots=True)
class RowPlan:
    meta: AttentionMetadata
    blocks: torch.Tensor  # [T, num_blocks] int64: each query row's sequence's block table
    key_counts: torch.Tensor  # [T] int64: the keys each row attends to (its position + 1)


class CpuPagedAttention:
    name = "cpu-paged"

    def __init__(self, kernel: Callable[..., torch.Tensor]) -> None:
        self.kernel = kernel

    @staticmethod
    def plan(meta: AttentionMetadata, block_size: int) -> RowPlan:
        """Once per step: which blocks and how many keys each query row sees."""
        num_blocks = -(-max(meta.seq_lens_host) // block_size)
        table = meta.block_table[:, :num_blocks].long()
        if meta.max_seqlen_q == 1:  # decode only: a row per sequence, all its keys
            return RowPlan(meta, table, meta.seq_lens.long())
        query_lens = torch.tensor(meta.query_lens)
        seq_of_row = torch.repeat_interleave(torch.arange(len(meta.query_lens)), query_lens)
        offset = torch.arange(seq_of_row.numel()) - meta.cu_seqlens_q[:-1].long()[seq_of_row]
        cached = meta.seq_lens.long() - query_lens  # keys before this step's tokens
        return RowPlan(meta, table[seq_of_row], cached[seq_of_row] + offset + 1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, plan: RowPlan | AttentionMetadata, scale: float, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]. window, softcap: see
        AttentionBackend."""
        if isinstance(plan, AttentionMetadata):
            plan = self.plan(plan, k_cache.shape[1])
        # the kernel writes this step's keys and values to their slots first: its prefill rows read them
        return self.kernel(q, k_cache, v_cache, plan.blocks, plan.key_counts, scale, window, softcap,
                           k, v, plan.meta.slot_mapping)
