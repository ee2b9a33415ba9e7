"""One sequence's place in its grammar: which tokens may come next, and whether it is complete."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import xgrammar


class GrammarState:
    """An xgrammar matcher that has accepted every output token of its sequence so far.

    It lives on the Sequence, not in the KV cache, so preemption by recompute keeps it as it is: the
    recomputed tokens were accepted once already and the next sampled token continues from here."""

    __slots__ = ("matcher", "rejected")

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.rejected = False  # a token the grammar refused was sampled: the sequence must end

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        ok = bool(self.matcher.accept_token(token_id))
        self.rejected = self.rejected or not ok
        return ok

    @property
    def finished(self) -> bool:
        """The grammar accepted a stop token (it is complete) or cannot go on."""
        return self.rejected or bool(self.matcher.is_terminated())
