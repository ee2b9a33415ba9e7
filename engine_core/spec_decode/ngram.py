"""Prompt lookup (vLLM's `NgramProposer`): find the longest suffix n-gram of the context, prompt and output,
that occurred earlier, and propose the tokens that followed it there."""

from __future__ import annotations

import numpy as np

from engine_core.sequence import Sequence


def lookup(tokens: np.ndarray, low: int, high: int, k: int) -> list[int]:
    """The tokens after the earliest earlier occurrence of the longest suffix n-gram, low <= n <= high
    (vLLM's rule: longest n first, earliest occurrence on ties); [] when none occurred."""
    length = len(tokens)
    for n in range(min(high, length - 1), low - 1, -1):
        hits = tokens[: length - n] == tokens[length - n]  # window i holds tokens[i:i+n], i < length - n
        for j in range(1, n):
            hits &= tokens[j: length - n + j] == tokens[length - n + j]
        found = np.flatnonzero(hits)
        if found.size:
            start = int(found[0]) + n
            return tokens[start: start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [lookup(np.asarray(seq.token_ids, dtype=np.int64), self.low, self.high, k)
                for seq, k in zip(seqs, limits)]

    def finish(self, seq: Sequence) -> None:
        pass
