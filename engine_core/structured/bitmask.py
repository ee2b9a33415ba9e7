"""Mask a step's logits to what each constrained sequence's grammar allows next.

Called on the logits straight from compute_logits, before penalties, min_tokens and sampling (vLLM's
order), so greedy, sampling and logprobs all see the masked distribution. Unconstrained rows in the
same step are not touched.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine_core.sequence import Sequence


class TokenBitmask:
    """One reusable int32 [rows, ceil(vocab/32)] host buffer; bit j%32 of word j//32 allows token j."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, seqs: Seq[Sequence],
              argmax_only: Callable[[Sequence], bool] = lambda s: False) -> None:
        """Mask the constrained rows in place. A row whose sequence takes only the argmax (`argmax_only`:
        plain greedy, no logprobs) is masked only when its top token is not allowed: the first maximum
        is then the masked argmax too, exactly, and masking the whole vocab (most of the mask's cost at
        batch 32) is skipped."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
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
        greedy = [i for i in rows if argmax_only(seqs[i])]
        if greedy:
            top = logits[greedy].max(dim=-1).indices.to(mask.device)
            allowed = (mask[greedy, top // 32] >> (top % 32)) & 1
            refused = {i for i, ok in zip(greedy, allowed.tolist()) if not ok}
            rows = [i for i in rows if i not in greedy or i in refused]
            if not rows:
                return
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        # xgrammar's native kernel on CPU (fp32/bf16/fp16), its Triton kernel on CUDA
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=rows)
