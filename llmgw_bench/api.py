"""One timed streaming request per API, with `vllm bench serve`'s clock.

The clock starts before the request is sent. Each streamed event that carries generated text is stamped:
the first gives TTFT, each later one adds its gap to ITL, and the last gives the end-to-end latency.
Output tokens come from the server's usage (OpenAI) or `details.generated_tokens` (TGI) when present.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from backends.upstream.sse import SSEParser
from llmgw_bench.workload import Sample

APIS = ("openai-chat", "openai-completions", "tgi")
PATHS = {"openai-chat": "/v1/chat/completions", "openai-completions": "/v1/completions", "tgi": "/generate_stream"}


@dataclass
class RequestResult:
    start: float  # seconds since the run began
    input_len: int  # as the workload's tokenizer counted the prompt
    ok: bool = False
    error: str | None = None  # a kind: http_429, timeout, connection, disconnected, stream_error, incomplete
    detail: str = ""
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    output_tokens: int | None = None
    output_tokens_from: str = ""  # usage | details | tokenizer | chunks
    prompt_tokens: int | None = None  # the server's count, where it reports one
    text: str = ""

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "text"}


def request_body(api: str, sample: Sample, *, model: str | None, temperature: float, ignore_eos: bool,
                 seed: int | None) -> dict[str, Any]:
    if api == "tgi":
        parameters: dict[str, Any] = {"max_new_tokens": sample.output_len, "details": True,
                                      "do_sample": temperature > 0}
        if temperature > 0:
            parameters["temperature"] = temperature
        if seed is not None:
            parameters["seed"] = seed
        return {"inputs": sample.prompt, "parameters": parameters}
    body: dict[str, Any] = {"model": model, "max_tokens": sample.output_len, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": temperature}
    if api == "openai-chat":
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension; this gateway's too
    if seed is not None:
        body["seed"] = seed
    return body


class _Stream:
    """Reads one API's events into a RequestResult."""

    def __init__(self, api: str, result: RequestResult, sent_at: float) -> None:
        self.api, self.result, self.sent_at = api, result, sent_at
        self.last: float | None = None
        self.finished = False
        self.pieces: list[str] = []

    def event(self, data: str, now: float) -> None:
        if data == "[DONE]":
            return
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            self._fail("stream_error", f"not JSON: {data[:200]}")
            return
        if not isinstance(payload, dict):
            self._fail("stream_error", f"unexpected event: {data[:200]}")
            return
        if "error" in payload:
            self._fail("stream_error", json.dumps(payload["error"])[:500])
            return
        text = self._tgi(payload) if self.api == "tgi" else self._openai(payload)
        if text is None:
            return
        self.pieces.append(text)
        self.result.chunks += 1
        if self.last is None:
            self.result.ttft = now - self.sent_at
        else:
            self.result.itl.append(now - self.last)
        self.last = now

    def _openai(self, payload: dict[str, Any]) -> str | None:
        usage = payload.get("usage")
        if usage:
            self.result.output_tokens, self.result.output_tokens_from = usage.get("completion_tokens"), "usage"
            self.result.prompt_tokens = usage.get("prompt_tokens")
        choices = payload.get("choices") or []
        if not choices:
            return None
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finished = True
        if self.api == "openai-chat":
            delta = choice.get("delta") or {}
            text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
        else:
            text = choice.get("text")
        return text or None

    def _tgi(self, payload: dict[str, Any]) -> str | None:
        if payload.get("generated_text") is not None:
            self.finished = True
            details = payload.get("details") or {}
            if details.get("generated_tokens") is not None:
                self.result.output_tokens, self.result.output_tokens_from = details["generated_tokens"], "details"
        token = payload.get("token")
        if token is None:
            return None
        return "" if token.get("special") else token.get("text", "")

    def _fail(self, kind: str, detail: str) -> None:
        if self.result.error is None:
            self.result.error, self.result.detail = kind, detail

    def close(self) -> None:
        self.result.text = "".join(self.pieces)
        if self.last is not None:
            self.result.latency = self.last - self.sent_at
        if self.result.error is None and not self.finished:
            self._fail("incomplete", "the stream ended without a finish")
        self.result.ok = self.result.error is None and self.last is not None
        if self.result.ok and self.result.output_tokens is None:
            self.result.output_tokens, self.result.output_tokens_from = self.result.chunks, "chunks"


async def send(session: aiohttp.ClientSession, url: str, api: str, body: dict[str, Any], result: RequestResult,
               clock_zero: float) -> RequestResult:
    sent_at = time.perf_counter()
    result.start = sent_at - clock_zero
    stream = _Stream(api, result, sent_at)
    try:
        async with session.post(url + PATHS[api], json=body) as response:
            if response.status != 200:
                stream._fail(f"http_{response.status}", (await response.text())[:500])
                return result
            parser = SSEParser()
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                for event in parser.feed(chunk):
                    stream.event(event.data, now)
            for event in parser.finish():
                stream.event(event.data, time.perf_counter())
    except TimeoutError:
        stream._fail("timeout", "no answer within the request timeout")
    except aiohttp.ClientConnectorError as exc:
        stream._fail("connection", str(exc))
    except aiohttp.ClientError as exc:
        stream._fail("disconnected", f"{type(exc).__name__}: {exc}")
    finally:
        stream.close()
    return result
