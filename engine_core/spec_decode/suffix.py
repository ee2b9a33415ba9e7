"""SuffixDecoding (arXiv 2411.04975; vLLM `method="suffix"`) over a bounded index of this model's recent
requests: agents repeat themselves across requests (a tool result comes back in the next prompt, a file
is rewritten with one edit), not only within one.

Every position of every indexed sequence, the running ones and the last `max_cached_requests` finished
ones, is filed under the two tokens before it. A proposal looks up the context's last two tokens, extends
each earlier occurrence's match backwards (at most `max_depth` tokens), keeps the occurrences with the
longest match, and walks forward along their most common next token, as a walk down the suffix tree's
matched node would: it stops when the path's estimated probability (the share of occurrences that agree,
multiplied along the path) drops below `min_token_prob`, or at max_spec_factor x the match length.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from engine_core.sequence import Sequence

KEY = 2  # tokens a position is filed under
MAX_OCCURRENCES = 64  # most recent occurrences kept per key, and examined per proposal
MAX_SPEC_FACTOR = 1.0  # vLLM's suffix_decoding_max_spec_factor


class SuffixIndex:
    def __init__(self, max_depth: int, max_cached_requests: int, min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.max_cached = max_cached_requests
        self.min_token_prob = min_token_prob
        self.sequences: dict[int, list[int]] = {}  # uid -> its tokens (a running sequence's own list)
        self.indexed: dict[int, int] = {}  # uid -> positions filed so far
        self.finished: OrderedDict[int, None] = OrderedDict()  # oldest first, for eviction
        self.occurrences: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.uids: dict[str, int] = {}
        self._next_uid = 0

    def update(self, request_id: str, tokens: list[int]) -> int:
        """File the positions of `tokens` not filed yet; returns the sequence's uid."""
        uid = self.uids.get(request_id)
        if uid is None:
            uid = self.uids[request_id] = self._next_uid
            self._next_uid += 1
            self.sequences[uid], self.indexed[uid] = tokens, KEY
        for position in range(self.indexed[uid], len(tokens) + 1):  # len(tokens): the context's own end
            places = self.occurrences.setdefault((tokens[position - 2], tokens[position - 1]), [])
            places.append((uid, position))
            if len(places) > 2 * MAX_OCCURRENCES:
                del places[:MAX_OCCURRENCES]
        self.indexed[uid] = max(KEY, len(tokens) + 1)
        return uid

    def retire(self, request_id: str) -> None:
        """A request finished: keep its tokens as they are for later requests, evicting the oldest."""
        uid = self.uids.pop(request_id, None)
        if uid is None:
            return
        self.sequences[uid] = list(self.sequences[uid])
        self.finished[uid] = None
        while len(self.finished) > self.max_cached:
            old, _ = self.finished.popitem(last=False)
            del self.sequences[old], self.indexed[old]  # its occurrences are skipped, then pushed out

    def propose(self, tokens: list[int], uid: int, k: int) -> list[int]:
        if len(tokens) < KEY:
            return []
        places = self.occurrences.get((tokens[-2], tokens[-1]), [])
        best, matched = 0, []
        for other, position in reversed(places[-MAX_OCCURRENCES:]):
            seq = self.sequences.get(other)
            if seq is None or position >= len(seq) or (other == uid and position >= len(tokens)):
                continue  # evicted, nothing follows yet, or the context's own end
            length = KEY
            while (length < self.max_depth and length < position and length < len(tokens)
                   and seq[position - length - 1] == tokens[-length - 1]):
                length += 1
            if length > best:
                best, matched = length, [(seq, position)]
            elif length == best:
                matched.append((seq, position))
        draft: list[int] = []
        probability = 1.0
        limit = min(k, int(best * MAX_SPEC_FACTOR))
        while matched and len(draft) < limit:
            nexts = Counter(seq[position] for seq, position in matched)
            token, count = nexts.most_common(1)[0]
            probability *= count / len(matched)
            if probability < self.min_token_prob:
                break
            draft.append(token)
            matched = [(seq, position + 1) for seq, position in matched
                       if seq[position] == token and position + 1 < len(seq)]
        return draft


class SuffixProposer:
    def __init__(self, max_depth: int, max_cached_requests: int, min_token_prob: float) -> None:
        self.index = SuffixIndex(max_depth, max_cached_requests, min_token_prob)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, limits):
            uid = self.index.update(seq.request_id, seq.token_ids)
            drafts.append(self.index.propose(seq.token_ids, uid, k))
        return drafts

    def finish(self, seq: Sequence) -> None:
        self.index.update(seq.request_id, seq.token_ids)
        self.index.retire(seq.request_id)
