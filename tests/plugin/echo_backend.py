"""A third-party backend, registered through the `llm_gateway.backends` entry point group in tests.

It echoes its input word by word: the prompt, or (when it takes chat natively) the last message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import ClassVar

import msgspec

from backends.base import BackendInfo, FinishReason, GenerationRequest, TokenEvent, TokenSpan, Usage


class EchoSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    type: str = "echo-test"
    start_delay: float = 0.0
    accepts_chat: bool = False
    fail_start: bool = False  # a backend that never comes up
    start_gate: str = ""  # a file: the start ends only once it exists (a test, not a delay, decides when)


class EchoBackend:
    type_name: ClassVar[str] = "echo-test"
    Settings: ClassVar[type[msgspec.Struct]] = EchoSettings

    def __init__(self, name: str, settings: EchoSettings) -> None:
        self.name = name
        self.settings = settings
        self.ready = False

    async def start(self) -> None:
        await asyncio.sleep(self.settings.start_delay)
        while self.settings.start_gate and not Path(self.settings.start_gate).exists():
            await asyncio.sleep(0.02)
        if self.settings.fail_start:
            raise ConnectionError("echo backend configured never to start")
        self.ready = True

    async def health(self) -> bool:
        return self.ready

    def info(self) -> BackendInfo:
        return BackendInfo(backend_type=self.type_name, model_id="echo", max_model_len=512,
                           chat_template="{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
                           accepts_chat_messages=self.settings.accepts_chat)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[TokenSpan]:
        spans, start = [], 0
        for i, word in enumerate(text.split(" ")):
            spans.append(TokenSpan(id=i, text=word, start=start, stop=start + len(word.encode())))
            start += len(word.encode()) + 1
        return spans

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        source = request.messages[-1].content if request.messages else (request.prompt or "")
        words = source.split(" ")[: request.max_new_tokens]
        for i, word in enumerate(words):
            last = i == len(words) - 1
            text = word if i == 0 else " " + word
            yield TokenEvent(token_id=i, text=text, token_text=text, logprob=-1.0,
                             finish_reason=FinishReason.LENGTH if last else None,
                             usage=Usage(len(source.split(" ")), len(words)) if last else None)

    async def aclose(self) -> None:
        self.ready = False
