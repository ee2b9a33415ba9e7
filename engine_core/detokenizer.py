"""Incremental detokenization with stop strings.

Text is decoded over a short sliding window of ids and only released once it no longer ends in
an incomplete UTF-8 sequence (U+FFFD), so a multi-byte character is never split. Output text that
could still grow into a stop string is held back; once a stop string appears the text before it
is released and the sequence finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROMPT_CONTEXT_TOKENS = 5  # some prompt tokens give the first output token its leading-space context


@dataclass(slots=True)
class DetokenizedStep:
    token_text: str  # text this token completed (special tokens included), TGI's `token.text`
    text: str  # output text released by this step (never part of a stop string)
    stop_string: str | None = None  # set when a stop string ended the sequence


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: Any
    prompt_token_ids: list[int]
    stop: list[str]
    skip_special_tokens: bool = True
    special_ids: frozenset[int] = frozenset()
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    output_text: str = ""
    released: int = 0  # characters of output_text already released

    def __post_init__(self) -> None:
        self.ids = list(self.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> DetokenizedStep:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        token_text = ""
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            token_text = new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        grown = 0
        if not (self.skip_special_tokens and token_id in self.special_ids):
            self.output_text += token_text
            grown = len(token_text)
        return self._release(token_text, grown)

    def _release(self, token_text: str, grown: int) -> DetokenizedStep:
        if self.stop:
            longest = max(len(s) for s in self.stop)
            search_from = max(0, len(self.output_text) - grown - longest + 1)
            hits = [(i, s) for s in self.stop if (i := self.output_text.find(s, search_from)) >= 0]
            if hits:
                index, stop = min(hits)
                text = self.output_text[self.released:index]
                self.output_text = self.output_text[:index]
                self.released = index
                return DetokenizedStep(token_text, text, stop)
        end = len(self.output_text) - self._held_back()
        text = self.output_text[self.released:end] if end > self.released else ""
        self.released = max(self.released, end)
        return DetokenizedStep(token_text, text)

    def _held_back(self) -> int:
        """Length of the longest output suffix that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.output_text)), best, -1):
                if self.output_text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """On a finish other than a stop string, the held-back text is released after all."""
        text = self.output_text[self.released:]
        self.released = len(self.output_text)
        return text
