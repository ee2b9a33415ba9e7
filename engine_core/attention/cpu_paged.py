"""Decode attention for CPU that reads keys and values in place from the paged cache.

The torch reference gathers every decoding sequence's blocks into a padded [B, Hkv, L, D] copy, then
transposes (another copy) for its matmuls: at batch 128 that was about 60% of a decode step (profile
in BENCHMARKS.md). The compiled kernel (`engine_core/csrc/paged_decode.cpp`, built by
`engine_core.cpu_kernels`) walks each sequence's block table instead, scores and softmax in fp32.
Prefill chunks use the reference path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_core.attention.torch_ref import DecodePlan, TorchReferenceAttention
from engine_core.cpu_kernels import cpu_kernels


def paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """The compiled kernel, or None when it cannot be built here."""
    module = cpu_kernels()
    return None if module is None else module.paged_decode


class CpuPagedAttention(TorchReferenceAttention):
    name = "cpu-paged"

    def __init__(self, kernel: Callable[..., torch.Tensor]) -> None:
        self.kernel = kernel

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
                scale: float, out: torch.Tensor) -> None:
        qs = q if plan.rows is None else q[plan.rows]
        o = self.kernel(qs, k_cache, v_cache, plan.blocks, plan.seq_lens, scale)
        if plan.rows is None:
            out.copy_(o)
        else:
            out[plan.rows] = o
