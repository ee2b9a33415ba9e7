"""An OpenAI-compatible server's streamed chunks (and whole answers' choices) read as token events: text,
logprobs, tool-call pieces, the finish and its reason, the usage chunk (with prefix-cache hits), and an error
sent inside the stream as the backend error of its status. vLLM, trtllm-serve, SGLang and llama.cpp's server
speak it, and so do TGI's and Triton's OpenAI routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from backends.base import FinishReason, TokenEvent, TokenLogprob, UpstreamError, Usage
from backends.tool_calls import ToolCallRelay
from backends.upstream.http import drain, error_for_status
from backends.upstream.sse import SSEEvent
from backends.upstream.text import UpstreamText


async def relay_openai_stream(events: AsyncIterator[SSEEvent], backend: str, chat: bool,
                              text: UpstreamText | None = None,
                              tools: ToolCallRelay | None = None) -> AsyncIterator[TokenEvent]:
    """An OpenAI-style event stream as token events. The finish is held until the usage chunk
    that follows it; `text`, where given, cuts stop strings the upstream left in its text."""
    tools = tools or ToolCallRelay(backend)
    final: TokenEvent | None = None
    count = 0
    async for sse in events:
        if sse.data.strip() == "[DONE]":
            await drain(events)
            break
        chunk = decode_chunk(sse.data, backend)
        if chunk.get("error") is not None or chunk.get("object") == "error":
            raise stream_error(chunk, backend)
        for choice in chunk.get("choices") or []:
            for event in chunk_events(choice, chat, tools):
                count += 1
                if event.finished:
                    if text is not None:
                        event.text = text.finish(event.text)
                        event.stop_string = event.stop_string or text.stop_string
                    final = event
                else:
                    if text is not None:
                        event.text = text.push(event.text)
                    yield event
        usage = chunk.get("usage")
        if usage and final is not None:
            final.usage = Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or count),
                                cached_tokens(usage))
    tools.finish()
    if final is not None:
        final.usage = final.usage or Usage(0, count)
        yield final


def decode_chunk(data: str, backend: str) -> dict[str, Any]:
    try:
        chunk = msgspec.json.decode(data)
    except msgspec.DecodeError:
        raise UpstreamError(f"{backend}: not JSON in the event stream: {data[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise UpstreamError(f"{backend}: unexpected event: {data[:200]!r}")
    return chunk


def cached_tokens(usage: dict[str, Any]) -> int:
    """vLLM's (and OpenAI's) prefix-cache hits: usage.prompt_tokens_details.cached_tokens, when reported."""
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0


def stream_error(chunk: dict[str, Any], backend: str) -> Exception:
    error = chunk.get("error", chunk)
    if isinstance(error, dict):
        message = str(error.get("message") or error)
        code = error.get("code")
        status = code if isinstance(code, int) else int(error.get("http_status_code") or 500)
    else:
        message, status = str(error), 500
    return error_for_status(status, message, backend)


def _finish(choice: dict[str, Any]) -> tuple[FinishReason | None, str | None]:
    reason = choice.get("finish_reason")
    if not reason:
        return None, None
    if reason == "length":
        return FinishReason.LENGTH, None
    if reason in ("tool_calls", "function_call"):  # the door decides what its client sees
        return FinishReason.TOOL_CALLS, None
    stop_reason = choice.get("stop_reason")
    if reason == "stop_sequence" or isinstance(stop_reason, str):
        return FinishReason.STOP_SEQUENCE, stop_reason if isinstance(stop_reason, str) else None
    return FinishReason.EOS_TOKEN, None


def chunk_events(choice: dict[str, Any], chat: bool, tools: ToolCallRelay) -> list[TokenEvent]:
    """One chunk's choice as token events: one per logprob entry when there are any, else one.
    Its tool-call pieces go on the last."""
    delta = (choice.get("delta") or {}) if chat else {}
    text = (delta.get("content") if chat else choice.get("text")) or ""
    calls = tools.feed(delta.get("tool_calls"))
    reason, stop_string = _finish(choice)
    entries = _logprob_entries(choice.get("logprobs"), chat)
    ids = choice.get("token_ids") or []
    if not text and reason is None and not entries and not calls:
        return []  # the role-only first chunk, an empty keep-alive delta, a call's held-back name
    if not entries:  # no logprobs: one event per token id when the chunk carries several
        entries = [("", None, []) for _ in ids[:-1]] + [(text, None, [])]
    events = []
    for i, (token_text, logprob, top) in enumerate(entries):
        last = i == len(entries) - 1
        events.append(TokenEvent(token_id=ids[i] if i < len(ids) else 0, text=text if last else "",
                                 token_text=token_text, logprob=logprob, top_logprobs=top))
    events[-1].finish_reason = reason
    events[-1].stop_string = stop_string
    events[-1].tool_calls = calls
    return events


def _logprob_entries(logprobs: Any, chat: bool) -> list[tuple[str, float | None, list[TokenLogprob]]]:
    if not isinstance(logprobs, dict):
        return []
    if chat:
        return [(e.get("token", ""), e.get("logprob"),
                 [TokenLogprob(0, t.get("token", ""), t.get("logprob")) for t in e.get("top_logprobs") or []])
                for e in logprobs.get("content") or []]
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    return [(tok, values[i] if i < len(values) else None,
             [TokenLogprob(0, t, v) for t, v in (tops[i] or {}).items()] if i < len(tops) and tops[i] else [])
            for i, tok in enumerate(tokens)]
