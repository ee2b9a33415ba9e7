"""The one SSE reader: any way the network splits a stream, the same events come out."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.upstream.sse import SSEParser, iter_sse

STREAM = (b'data: {"a":1}\n\n'
          b": keep-alive\n\n"
          b'data: {"b":"x\xc3\xa9"}\r\n\r\n'
          b"event: message\ndata: line one\ndata: line two\n\n"
          b"data:no-space\r\r"
          b"data: [DONE]\n\n")
EXPECTED = ['{"a":1}', '{"b":"xé"}', "line one\nline two", "no-space", "[DONE]"]


def parse(pieces: list[bytes]) -> list[str]:
    parser = SSEParser()
    events = [e.data for piece in pieces for e in parser.feed(piece)]
    return events + [e.data for e in parser.finish()]


def test_whole_stream_in_one_read() -> None:
    assert parse([STREAM]) == EXPECTED


def test_one_byte_at_a_time() -> None:
    assert parse([STREAM[i:i + 1] for i in range(len(STREAM))]) == EXPECTED


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=20))
def test_any_split_gives_the_same_events(cuts: list[int]) -> None:
    points = [0, *sorted(cuts), len(STREAM)]
    assert parse([STREAM[a:b] for a, b in zip(points, points[1:])]) == EXPECTED


def test_last_event_without_blank_line_or_done_still_counts() -> None:
    assert parse([b'data: {"x":1}\n\ndata: {"y":2}']) == ['{"x":1}', '{"y":2}']
    assert parse([b"data: tail\r"]) == ["tail"]


def test_comments_only_give_no_events() -> None:
    assert parse([b":\n\n:\n\n"]) == []


def test_async_reader_over_chunks() -> None:
    async def chunks():
        for i in range(0, len(STREAM), 3):
            yield STREAM[i:i + 3]

    async def collect() -> list[str]:
        return [e.data async for e in iter_sse(chunks())]

    assert asyncio.run(collect()) == EXPECTED
