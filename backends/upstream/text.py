"""Text from upstreams that stream raw token text: stop strings are cut and never sent in part."""

from __future__ import annotations

from engine_core.text.stop_strings import StopStringBuffer


class UpstreamText:
    def __init__(self, stop: list[str]) -> None:
        self.buffer = StopStringBuffer(list(stop))
        self.stop_string: str | None = None

    def push(self, text: str) -> str:
        """The part of the output that is safe to release after `text` arrived."""
        if self.stop_string is not None:
            return ""
        released = self.buffer.push(text)
        self.stop_string = released.stop_string
        return released.text

    def finish(self, text: str) -> str:
        """The last token's text plus whatever was held back (unless a stop string matched)."""
        released = self.push(text)
        return released if self.stop_string is not None else released + self.buffer.flush()
