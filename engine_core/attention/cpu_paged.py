"""Decode attention for CPU that reads keys and values in place from the paged cache.

The torch reference gathers every decoding sequence's blocks into a padded [B, Hkv, L, D] copy, then
transposes (another copy) for its matmuls: at batch 128 that was about 60% of a decode step (profile
in BENCHMARKS.md). `csrc/paged_decode.cpp` walks each sequence's block table instead, one
(sequence, KV head) pair per task, scores and softmax in fp32. It is compiled once per machine by
torch's extension builder (cached under ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) for
this CPU (-march=native, or $LLMGW_KERNEL_MARCH) with OpenMP, so that torch's threads share the
work; with no C++ compiler the engine keeps the reference
path. Prefill chunks use the reference path.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from engine_core.attention.torch_ref import DecodePlan, TorchReferenceAttention

log = logging.getLogger("llmgw.engine")
SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
# the target CPU: "native" where it runs; an image built on one machine for others sets e.g. x86-64-v3
MARCH_ENV = "LLMGW_KERNEL_MARCH"
_kernel: Callable[..., torch.Tensor] | None = None
_tried = False


def paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """The compiled kernel, built on first use; None when it cannot be built here."""
    global _kernel, _tried
    if not _tried:
        _tried = True
        march = os.environ.get(MARCH_ENV, "native")
        name = f"llmgw_paged_decode_{march.replace('-', '_')}"
        try:
            try:  # built ahead of time and installed as a module (the container image does this)
                module = importlib.import_module(name)
            except ImportError:
                from torch.utils.cpp_extension import load

                # -fopenmp: at::parallel_for is a header template, so without it the kernel runs on one thread
                module = load(name=name, sources=[str(SOURCE)],
                              extra_cflags=["-O3", f"-march={march}", "-ffast-math", "-fopenmp"],
                              extra_ldflags=["-fopenmp"], verbose=False)
            _kernel = module.paged_decode
        except Exception as exc:  # no compiler, no headers: the reference path still works
            log.warning("CPU paged-decode kernel unavailable, using the torch reference: %s", exc)
    return _kernel


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
