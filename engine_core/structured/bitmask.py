"""Mask a step's logits to what each constrained sequence's grammar allows next.

Called on the logits straight from compute_logits, before penalties, min_tokens and sampling (vLLM's
order), so greedy, sampling and logprobs all see the masked distribution. Unconstrained rows in the
same step are not touched. The sampler may also call it after choosing, for the rows whose choice the
grammar refused (see `Sampler`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from engine_core.cpu.kernels import cpu_kernels

if TYPE_CHECKING:
    from engine_core.sequence import Sequence


class TokenBitmask:
    """One reusable int32 [rows, ceil(vocab/32)] host buffer; bit j%32 of word j//32 allows token j."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def mask_rows(self, logits: torch.Tensor, seqs: Seq[Sequence], rows: list[int]) -> None:
        """Fill the grammar masks of `rows` (indices into seqs and logits) and apply them in place."""
        if not rows:
            return
        import xgrammar as xgr

        # the width comes from the logits, i.e. the model's vocab: ids past the tokenizer's vocab (padding)
        # get a 0 bit and so can never be sampled
        vocab = logits.shape[1]
        buffer = self._buffer
        if buffer is None or buffer.shape[0] < len(seqs) or buffer.shape[1] * 32 < vocab:
            buffer = self._buffer = xgr.allocate_token_bitmask(max(len(seqs), 8), vocab)
        # one matcher at a time: for a few dozen rows this is ~2 us each, less than BatchGrammarMatcher's
        # thread hand-off costs on a small machine (measured at batch 8 and 32)
        for i in rows:
            seqs[i].grammar.fill(buffer, i)  # type: ignore[union-attr]
        mask = buffer[: len(seqs)]
        kernels = cpu_kernels() if logits.device.type == "cpu" and logits.is_contiguous() else None
        if kernels is not None and hasattr(kernels, "apply_token_bitmask_"):
            kernels.apply_token_bitmask_(logits, mask, rows)  # word by word: ~10x under xgrammar's CPU kernel
            return
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        # xgrammar's native kernel on CPU (fp32/bf16/fp16), its Triton kernel on CUDA
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=rows)
