"""The compiled grammar-bitmask kernel against xgrammar's own, on both kinds of CPU build."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import ISAS, kernels_for

xgr = pytest.importorskip("xgrammar")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 1000])  # a whole number of words, and a ragged last word
def test_bitmask_kernel_masks_exactly_the_refused_tokens_of_the_chosen_rows(isa: str, dtype: torch.dtype,
                                                                               vocab: int) -> None:
    kernels = kernels_for(isa)
    g = torch.Generator().manual_seed(0)
    rows, words = 6, (vocab + 31) // 32
    # words of every kind: all allowed, all refused, and random bits
    mask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    mask[0, ::3] = -1
    mask[1, 1::3] = 0
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    chosen = [0, 1, 4]
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, mask, vocab_size=vocab, indices=chosen)
    kernels.apply_token_bitmask_(logits, mask, chosen)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[1]).any() and torch.isfinite(logits[2]).all()  # row 2 was not chosen


def test_bitmask_kernel_refuses_a_row_outside_the_logits() -> None:
    with pytest.raises(RuntimeError, match="out of range"):
        kernels_for("avx2").apply_token_bitmask_(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), [2])
