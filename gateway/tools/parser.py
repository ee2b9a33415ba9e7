"""Generated text → content and tool calls, a piece at a time (streaming and whole answers alike).

Two modes:
- `auto`: the model chooses. Text is content until `<tool_call>`; the block after it is read as calls
  (a JSON list, or one call object per block) up to `</tool_call>`. Text that might be the start of
  the tag, and trailing whitespace, are held back, so markup never shows in `content`. A block that
  turns out not to be calls (before any call of it was shown) is given back as content, as vLLM's
  parsers do with text they cannot parse.
- forced (`required` or a named tool): the whole output is the JSON list a constraint forced, no tags.
"""

from __future__ import annotations

from collections.abc import Callable

from backends.base import ToolCallDelta
from gateway.tools.scanner import CallScanner, ScanError, new_call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that `tag` starts with (a tag that may be on its way)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    def __init__(self, *, forced: bool, parallel: bool = True, new_id: Callable[[], str] = new_call_id) -> None:
        self.forced = forced
        self.max_calls = None if parallel else 1
        self.new_id = new_id
        self.calls = 0  # calls shown so far, all blocks together
        self._held = ""  # text mode: what may still turn out to be markup
        self._scanner: CallScanner | None = None
        self._raw = ""  # the current block's text, given back as content if it is no call after all
        self._state = "text"  # text, block, after (its JSON ended), broken (it failed after a call was shown)
        if forced:
            self._open_block("")

    def _open_block(self, raw: str) -> None:
        self._scanner = CallScanner(self.calls, self.max_calls, self.new_id)
        self._raw, self._state, self._held = raw, "block", ""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while text:
            step = {"text": self._text, "block": self._block, "after": self._after, "broken": self._broken}
            text = step[self._state](text, content, deltas)
        return "".join(content), deltas

    def finish(self) -> str:
        """The content still held when the output ends."""
        held, self._held = self._held, ""
        if self._state == "block" and self._scanner is not None and self._scanner.reported == 0:
            return self._raw + held  # a block that never became a call: it was text after all
        if self._state != "text" or (self.calls and not held.strip()):
            return ""
        return held

    def _text(self, text: str, content: list[str], deltas: list[ToolCallDelta]) -> str:
        buf = self._held + text
        at = buf.find(OPEN)
        if at >= 0:
            before = buf[:at]
            kept = before.rstrip()
            content.append(kept)
            self._open_block(before[len(kept):] + OPEN)
            return buf[at + len(OPEN):]
        keep = len(buf) - _partial_suffix(buf, OPEN)
        released = buf[:keep].rstrip()
        content.append(released)
        self._held = buf[len(released):]
        return ""

    def _block(self, text: str, content: list[str], deltas: list[ToolCallDelta]) -> str:
        scanner = self._scanner
        assert scanner is not None
        try:
            deltas += scanner.feed(text)
        except ScanError as exc:
            deltas += exc.deltas
            self.calls = scanner.index
            if scanner.reported:  # calls of this block were shown already: drop the rest of it
                self._state, self._held = "broken", ""
                return text[exc.at:]
            content.append(self._raw + text[:exc.at])
            self._state = "text"
            return text[exc.at:]
        self.calls = scanner.index
        if not scanner.done:
            self._raw += text
            return ""
        self._state, self._held = "after", ""
        return scanner.rest

    def _after(self, text: str, content: list[str], deltas: list[ToolCallDelta]) -> str:
        """After a block's JSON: its closing tag, or (if the model left it out) text again."""
        if self.forced:
            return ""  # nothing may follow the forced calls; whitespace is all a constraint lets through
        buf = (self._held + text).lstrip()
        if buf.startswith(CLOSE):
            self._state, self._held = "text", ""
            return buf[len(CLOSE):]
        if CLOSE.startswith(buf):
            self._held = buf
            return ""
        self._state, self._held = "text", ""
        return buf

    def _broken(self, text: str, content: list[str], deltas: list[ToolCallDelta]) -> str:
        """A block that failed after showing calls: skipped up to its closing tag."""
        if self.forced:
            return ""
        buf = self._held + text
        at = buf.find(CLOSE)
        if at < 0:
            self._held = buf[len(buf) - _partial_suffix(buf, CLOSE):]
            return ""
        self._state, self._held = "text", ""
        return buf[at + len(CLOSE):]
