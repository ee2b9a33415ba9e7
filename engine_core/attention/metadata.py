"""The one contract between the model runner and every attention backend.

Tokens of all sequences in a step are laid out flat, sequence after sequence. For sequence i
its new queries are rows cu_seqlens_q[i]:cu_seqlens_q[i+1]; its keys and values (old and new)
are the first seq_lens[i] slots of the blocks listed in block_table[i]. Every new token's K/V is
written to slot_mapping[t] = block_id * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: KV length including this step's tokens
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_seqlen_q: int
    max_seqlen_k: int
    # host copies, so a CPU backend needs no device sync to plan its work
    query_lens: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(Protocol):
    """What the model calls in each layer. `plan` runs once per step (whatever depends only on the step's
    layout, the same for every layer); `forward` writes the step's keys and values into the cache and returns
    [T, Hq, D].

    Per layer (Gemma 3 mixes sliding and global layers in one step): `window` W > 0 lets the query at
    position p see only keys at p - W < k <= p, W keys its own included (transformers' sliding_window,
    FlashAttention's window (W - 1, 0)); `softcap` C > 0 replaces each score s = q·k * scale by
    C * tanh(s / C) before the mask and the softmax (Gemma 2's attn_logit_softcapping). 0 means none."""

    name: str

    def plan(self, meta: AttentionMetadata, block_size: int) -> Any: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, plan: Any, scale: float, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor: ...
