"""Stop strings over streamed text: hold back what could still become a stop string, cut at a match.

Used by the detokenizer and by remote backends whose upstream streams text that may contain a
stop sequence (TGI keeps it in its output), so no stream ever sends part of one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Released:
    text: str  # text safe to send now
    stop_string: str | None = None  # set when a stop string matched; nothing after it is released


@dataclass(slots=True)
class StopStringBuffer:
    stop: list[str] = field(default_factory=list)
    output_text: str = ""
    released: int = 0  # characters of output_text already released

    def push(self, text: str) -> Released:
        self.output_text += text
        if self.stop:
            longest = max(len(s) for s in self.stop)
            search_from = max(0, len(self.output_text) - len(text) - longest + 1)
            hits = [(i, s) for s in self.stop if (i := self.output_text.find(s, search_from)) >= 0]
            if hits:
                index, stop = min(hits)
                released = self.output_text[self.released:index]
                self.output_text = self.output_text[:index]
                self.released = index
                return Released(released, stop)
        end = len(self.output_text) - self._held_back()
        released = self.output_text[self.released:end] if end > self.released else ""
        self.released = max(self.released, end)
        return Released(released)

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
