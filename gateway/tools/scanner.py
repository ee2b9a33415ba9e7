"""An incremental reader of tool calls written as JSON: a list `[{"name": ..., "arguments": {...}}, ...]`
(SmolLM2's format) or one call object (Hermes' format, one per `<tool_call>` block).

It reads a character at a time, so a stream can show each call as soon as its name is complete and
then its arguments' text as it arrives, exactly as generated (no re-serialising: the streamed pieces
add up to the same `arguments` a whole answer gets). `parameters` is read as `arguments` (vLLM's key);
other keys are skipped. Anything that is not such JSON raises `ScanError`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from backends.base import ToolCallDelta

_WS = " \t\r\n"
_ARGUMENT_KEYS = ("arguments", "parameters")
_CLOSES = {"]": "[", "}": "{"}


class ScanError(ValueError):
    def __init__(self, message: str, at: int, deltas: list[ToolCallDelta] | None = None) -> None:
        super().__init__(message)
        self.at = at  # where in the text passed to feed() the scan failed
        self.deltas = deltas or []  # what that feed() read before it failed


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def merge_fragments(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Argument pieces of the same call that follow each other, as one."""
    merged: list[ToolCallDelta] = []
    for d in deltas:
        last = merged[-1] if merged else None
        if last is not None and last.id is None and d.id is None and last.index == d.index:
            merged[-1] = ToolCallDelta(index=d.index, arguments=last.arguments + d.arguments)
        else:
            merged.append(d)
    return merged


class CallScanner:
    """One JSON value of calls. `first_index` numbers its first call (calls of earlier blocks come
    before); calls past `max_calls` in all are read but not reported (`parallel_tool_calls: false`)."""

    def __init__(self, first_index: int = 0, max_calls: int | None = None,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.index = first_index  # the index the next call shown gets
        self.max_calls = max_calls
        self.new_id = new_id
        self.reported = 0  # calls of this value shown so far (their first delta sent)
        self.done = False
        self.rest = ""  # text after the value's end, from the feed() that reached it
        self._stack: list[str] = []
        self._in_string = False
        self._escape = False
        self._top: str | None = None
        self._between = "first"  # in a list, outside calls: "first" (a call or "]"), "item", "after"
        self._call_reset()

    def _call_reset(self) -> None:
        self._expect = "key_or_end"
        self._key: str | None = None
        self._target: str | None = None  # which string is being read: "key", "name", or None (skipped)
        self._raw = ""
        self._name: str | None = None
        self._capturing = False
        self._args_seen = False
        self._args_early = ""  # argument text read before the name
        self._ws = ""  # whitespace inside the arguments, held until more text follows it
        self._shown = False
        self._call_index = self.index
        self._skip = self.max_calls is not None and self.index >= self.max_calls

    @property
    def _call_depth(self) -> int:
        return 2 if self._top == "[" else 1

    def feed(self, text: str) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        for at, c in enumerate(text):
            if self.done:
                self.rest += text[at:]
                break
            try:
                self._char(c, out)
            except ScanError as exc:
                raise ScanError(str(exc), at, merge_fragments(out)) from None
        return merge_fragments(out)

    def _char(self, c: str, out: list[ToolCallDelta]) -> None:
        depth = len(self._stack)
        if self._capturing:
            if not self._in_string and depth == self._call_depth and c in ",}":
                self._capturing, self._ws = False, ""  # whitespace at its end is not part of the value
                self._expect = "after"
            else:
                self._track(c)
                self._argument_text(c, out)
                return
        if self._in_string:
            self._string_char(c, out)
            return
        if c in _WS:
            return
        if depth == 0:
            if c not in "[{":
                raise ScanError(f"calls must be a JSON list or object, not {c!r}", 0)
            self._top = c
            self._stack.append(c)
            self._call_reset()
        elif self._top == "[" and depth == 1:
            self._in_list(c)
        elif depth == self._call_depth:
            self._in_call(c, out)
        else:
            self._track(c)  # inside a value that is skipped

    def _in_list(self, c: str) -> None:
        if c == "{" and self._between in ("first", "item"):
            self._stack.append(c)
            self._call_reset()
        elif c == "," and self._between == "after":
            self._between = "item"
        elif c == "]" and self._between in ("first", "after"):
            self._stack.pop()
            self.done = True
        else:
            raise ScanError(f"unexpected {c!r} in the list of calls", 0)

    def _in_call(self, c: str, out: list[ToolCallDelta]) -> None:
        e = self._expect
        if e in ("key_or_end", "key") and c == '"':
            self._in_string, self._target, self._raw = True, "key", ""
        elif e in ("key_or_end", "value_in", "after") and c == "}":
            self._end_call(out)
        elif e in ("value_in", "after") and c == ",":
            self._expect = "key"
        elif e == "colon" and c == ":":
            self._expect = "value"
        elif e == "value" and self._key in _ARGUMENT_KEYS and not self._args_seen:
            self._args_seen = self._capturing = True
            self._track(c)
            self._argument_text(c, out)
        elif e == "value" and self._key == "name" and c == '"' and self._name is None:
            self._in_string, self._target, self._raw = True, "name", ""
        elif e in ("value", "value_in") and c not in ",:}":
            self._track(c)  # a value of another key, skipped
            self._expect = "value_in"
        else:
            raise ScanError(f"unexpected {c!r} in a call", 0)

    def _track(self, c: str) -> None:
        """Strings and nesting, for text that is only passed through or skipped."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
            return
        if c == '"':
            self._in_string, self._target = True, None
        elif c in "[{":
            self._stack.append(c)
        elif c in "]}":
            if not self._stack or self._stack[-1] != _CLOSES[c]:
                raise ScanError(f"unbalanced {c!r}", 0)
            self._stack.pop()

    def _string_char(self, c: str, out: list[ToolCallDelta]) -> None:
        if self._target is None:
            self._track(c)
            return
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            self._in_string = False
            try:
                value = json.loads(f'"{self._raw}"')
            except ValueError:
                raise ScanError("a bad string escape", 0) from None
            if self._target == "key":
                self._key, self._expect = value, "colon"
            else:
                self._name, self._expect = value, "after"
                self._show(out)
            return
        self._raw += c

    def _show(self, out: list[ToolCallDelta]) -> None:
        """The call's first delta, once its name is complete: id and name, and `arguments: ""`."""
        if self._skip:
            return
        self._shown = True
        self.reported += 1
        self._call_index = self.index
        self.index += 1
        out.append(ToolCallDelta(index=self._call_index, id=self.new_id(), name=self._name, arguments=""))
        if self._args_early:
            out.append(ToolCallDelta(index=self._call_index, arguments=self._args_early))
            self._args_early = ""

    def _argument_text(self, c: str, out: list[ToolCallDelta]) -> None:
        if c in _WS:
            self._ws += c
            return
        text, self._ws = self._ws + c, ""
        if self._skip:
            return
        if self._shown:
            out.append(ToolCallDelta(index=self._call_index, arguments=text))
        else:
            self._args_early += text

    def _end_call(self, out: list[ToolCallDelta]) -> None:
        if self._name is None:
            raise ScanError("a call without a name", 0)
        if not self._skip and not self._args_seen:
            out.append(ToolCallDelta(index=self._call_index, arguments="{}"))
        self._stack.pop()
        if self._top == "{":
            self.done = True
        else:
            self._between = "after"
