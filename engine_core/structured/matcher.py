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

    __slots__ = ("matcher", "rejected", "_accepted_ahead")

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.rejected = False  # a token the grammar refused was sampled: the sequence must end
        self._accepted_ahead: int | None = None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def try_accept(self, token_id: int) -> bool:
        """Accept `token_id` now if the grammar allows it (the sampler's check of an unmasked choice);
        a refused token leaves the matcher as it was. The step's `accept` of the same token is then a no-op."""
        ok = bool(self.matcher.accept_token(token_id))
        if ok:
            self._accepted_ahead = token_id
        return ok

    def accept(self, token_id: int) -> bool:
        if self._accepted_ahead is not None:
            ahead, self._accepted_ahead = self._accepted_ahead, None
            if ahead == token_id:
                return True
            self.rejected = True  # cannot happen: the sampler returns the token it checked
            return False
        ok = bool(self.matcher.accept_token(token_id))
        self.rejected = self.rejected or not ok
        return ok

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` the grammar accepts in a row from here; the matcher is rolled back after."""
        accepted = 0
        for token in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    @property
    def finished(self) -> bool:
        """The grammar accepted a stop token (it is complete) or cannot go on."""
        return self.rejected or bool(self.matcher.is_terminated())
