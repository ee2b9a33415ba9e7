"""The compiled CPU kernels' builds under test: each ISA level's build runs where this CPU has that ISA,
and is skipped with the reason elsewhere."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from engine_core.cpu.kernels import build_for_isa
from engine_core.models.layers.linear import ROUNDED_MIN_ROWS, rounding_allowed

ISAS = ["avx512_bf16", "avx2"]


def kernels_for(isa: str) -> ModuleType:
    build = build_for_isa(isa)
    if build is None:
        pytest.skip(f"this CPU cannot run the {isa} build (or there is no C++ compiler)")
    return build.module


def assert_rows_get_their_one_row_sums(step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """`step` over the first r rows of x, for every r from 2 to len(x), gives each row what it gives that row alone,
    to the bit (a speculative verify pass must score a position as a 1-row decode step does)."""
    alone = torch.cat([step(x[i:i + 1]) for i in range(x.shape[0])])
    for rows in range(2, x.shape[0] + 1):
        assert torch.equal(step(x[:rows]), alone[:rows]), f"a step of {rows} rows"


def assert_only_a_batch_step_takes(batch_kernel: Callable[[], torch.Tensor],
                                   layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` in a step without a verify pass: what it computes alone below ROUNDED_MIN_ROWS rows, from there
    `batch_kernel()`'s output, which differs from the exact one. Returns that step's output."""
    exact = layer(x)
    with rounding_allowed(True):
        batched = layer(x)
    assert batched.dtype == exact.dtype
    if x.shape[0] < ROUNDED_MIN_ROWS:
        assert torch.equal(batched, exact)
    else:
        assert torch.equal(batched, batch_kernel()) and not torch.equal(batched, exact)
    return batched
