"""Speculative decoding around the step: who drafts and how many tokens, how a verified row is judged, and
the counters (vLLM's `spec_decode` metrics).

The engine's step verifies the drafts: each drafted position's logits come from the same forward pass,
and the engine samples them one position after another with the normal sampler, each row seeing the
tokens emitted before it (penalties, min_tokens, the grammar's state). A position's sampled token y is
drawn from the target distribution p exactly as without speculation; the draft d is accepted iff y = d.
For a deterministic draft (n-gram, suffix, a greedy draft model: q = δ_d) this is Leviathan et al.'s rule:
P(accept) = p(d), and a rejected position's y is distributed as p with d removed, renormalised. It also
draws each position's noise from the request's generator in the order speculation-off would, so a seed
gives the same tokens with speculation on or off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine_core.sequence import Sequence
from engine_core.spec_decode.config import SpeculativeConfig
from engine_core.spec_decode.ngram import NgramProposer
from engine_core.spec_decode.suffix import SuffixProposer


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """At most limits[i] draft tokens to follow seqs[i]'s tokens."""

    def finish(self, seq: Sequence) -> None:
        """The request ended (finished or aborted): drop what is kept for it."""


MAX_BACKOFF = 64  # steps a request with poor acceptance waits at most before it drafts again
ACCEPTANCE_DECAY = 0.5  # weight of the past in a request's acceptance average


def draft_accepted(sampled: int, draft: int, logits: torch.Tensor) -> bool:
    """The acceptance rule (see the module doc). `logits` (the position's raw row) is unused by the exact
    rule; the tests swap in a lossy rule that reads it, to show the distribution test catches one."""
    return sampled == draft


@dataclass(slots=True)
class SpecCounters:
    """vLLM's names: drafts (verify passes with drafts), draft tokens, accepted tokens, and accepted by position."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens emitted by verify passes: accepted + one each
    accepted_per_pos: list[int] = field(default_factory=list)

    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts, vLLM's figure: tokens a verify pass yields."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(slots=True)
class Acceptance:
    accepted: float = float("inf")  # exponential average of the drafts a verify pass accepts; inf: none yet
    paused_for: int = 0  # steps left without drafts
    backoff: int = 1


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.acceptance: dict[str, Acceptance] = {}

    def propose(self, seqs: list[Sequence], num_running: int) -> None:
        """Set `spec_token_ids` of each sequence that sampled this step and may draft; [] for the others."""
        busy = self.config.disable_by_batch_size is not None and num_running >= self.config.disable_by_batch_size
        chosen, limits = [], []
        for seq in seqs:
            seq.spec_token_ids = []
            k = self._limit(seq)
            if busy or k <= 0 or not self._drafting(seq):
                continue
            chosen.append(seq)
            limits.append(k)
        if not chosen:
            return
        for seq, draft in zip(chosen, self.proposer.propose(chosen, limits)):
            if seq.grammar is not None:
                draft = draft[:seq.grammar.valid_prefix(draft)]  # a draft the grammar refuses cannot be accepted
            seq.spec_token_ids = draft

    def _limit(self, seq: Sequence) -> int:
        """Drafts worth verifying: none past max_tokens (the last emitted token is sampled, not drafted) or the
        model's length, and none for a request that asked for none."""
        if not seq.params.speculative:
            return 0
        left = min(seq.params.max_new_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return min(self.config.num_speculative_tokens, left)

    def _drafting(self, seq: Sequence) -> bool:
        state = self.acceptance.get(seq.request_id)
        if state is None or state.paused_for <= 0:
            return True
        state.paused_for -= 1
        return False

    def record(self, seq: Sequence, drafted: int, accepted: int, emitted: int, finished: bool) -> None:
        """One verify pass of `seq`: `drafted` tokens checked, the first `accepted` of them taken, `emitted`
        tokens out (accepted + 1, or accepted where an accepted draft ended the request)."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += drafted
        c.num_accepted_tokens += accepted
        c.num_emitted_tokens += emitted
        for position in range(accepted):
            c.accepted_per_pos[position] += 1
        if finished:
            return
        state = self.acceptance.setdefault(seq.request_id, Acceptance())
        past = state.accepted if state.accepted != float("inf") else accepted
        state.accepted = ACCEPTANCE_DECAY * past + (1 - ACCEPTANCE_DECAY) * accepted
        floor = self.config.min_accepted_tokens
        if state.accepted < floor:  # not paying for its rows: wait, longer each time
            state.paused_for = state.backoff
            state.backoff = min(2 * state.backoff, MAX_BACKOFF)
            state.accepted = floor  # one good pass after the pause resumes it
        elif accepted:
            state.backoff = 1

    def finish(self, seq: Sequence) -> None:
        self.acceptance.pop(seq.request_id, None)
        self.proposer.finish(seq)


def build_spec_decoder(config: SpeculativeConfig, max_model_len: int, draft: Proposer | None = None) -> SpecDecoder:
    """`draft`: the loaded draft model's proposer, for method "draft_model"."""
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramProposer(*config.lookup_range())
    elif config.method == "suffix":
        proposer = SuffixProposer(config.suffix_max_tree_depth, config.suffix_max_cached_requests,
                                  config.suffix_min_token_prob)
    else:
        assert draft is not None, "method draft_model needs the draft model's proposer"
        proposer = draft
    return SpecDecoder(config, proposer, max_model_len)
