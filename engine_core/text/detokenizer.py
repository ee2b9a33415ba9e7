"""Incremental detokenization with stop strings.

Text is decoded over a short sliding window of ids and only released once it no longer ends in
an incomplete UTF-8 sequence (U+FFFD), so a multi-byte character is never split. Output text that
could still grow into a stop string is held back (`StopStringBuffer`); once a stop string appears
the text before it is released and the sequence finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_core.text.stop_strings import StopStringBuffer

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
    stops: StopStringBuffer = field(default_factory=StopStringBuffer)

    def __post_init__(self) -> None:
        self.ids = list(self.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.read_offset = len(self.ids)
        self.stops = StopStringBuffer(list(self.stop))

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
        shown = "" if self.skip_special_tokens and token_id in self.special_ids else token_text
        released = self.stops.push(shown)
        return DetokenizedStep(token_text, released.text, released.stop_string)

    def flush(self) -> str:
        return self.stops.flush()
