"""One server-sent-events reader for every upstream.

Correct when an event is split across network reads, when several arrive in one read, when lines
end in CRLF (or a lone CR), when keep-alive comments arrive, and when the stream ends without a
final blank line or without `[DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass(slots=True)
class SSEEvent:
    data: str
    event: str | None = None


class SSEParser:
    """Feed bytes, get complete events. Keeps partial lines and partial events between feeds."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []
        self._event: bytes | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buffer += chunk
        events: list[SSEEvent] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                return events
            line, self._buffer = self._buffer[:cut[0]], self._buffer[cut[1]:]
            event = self._line(line)
            if event is not None:
                events.append(event)

    def finish(self) -> list[SSEEvent]:
        """At the end of the stream: a last event that lacked its blank line still counts."""
        events = []
        if self._buffer:
            event = self._line(self._buffer.rstrip(b"\r"))
            self._buffer = b""
            if event is not None:
                events.append(event)
        event = self._dispatch()
        if event is not None:
            events.append(event)
        return events

    def _line(self, line: bytes) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(b":"):  # a comment: keep-alive
            return None
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            self._data.append(value)
        elif field == b"event":
            self._event = value
        return None

    def _dispatch(self) -> SSEEvent | None:
        if not self._data:
            self._event = None
            return None
        event = SSEEvent(b"\n".join(self._data).decode("utf-8", errors="replace"),
                         self._event.decode() if self._event is not None else None)
        self._data, self._event = [], None
        return event


def _line_end(buffer: bytes) -> tuple[int, int] | None:
    """(end of line, start of next) for the first complete line, or None."""
    lf, cr = buffer.find(b"\n"), buffer.find(b"\r")
    if cr == -1 or (lf != -1 and lf < cr):
        return (lf, lf + 1) if lf != -1 else None
    if cr + 1 == len(buffer):
        return None  # a CR at the end of a read may be half of a CRLF
    return (cr, cr + 2) if buffer[cr + 1] == 0x0A else (cr, cr + 1)


async def iter_sse(chunks: AsyncIterator[bytes]) -> AsyncIterator[SSEEvent]:
    parser = SSEParser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event
    for event in parser.finish():
        yield event
