"""A local HTTP server that replays recorded upstream traffic byte for byte.

Each route answers with a scripted status, headers and body pieces; a piece is bytes to write
(as its own chunk, so events can be split across reads anywhere), a float to sleep, a Hold to wait
at until the test opens it, or CUT to drop the connection mid-stream. Every request is recorded for
assertions on what was sent, with when it arrived, when each chunk went out and whether the whole
answer did (the upstream's own clock: for ordering events, never for timing the gateway).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

CUT = object()


class Hold:
    """A point in a scripted answer where the upstream waits until the test opens it: the test, not
    a sleep that a slow machine might outlast, decides when the answer goes on."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.waiting = 0  # answers waiting here now

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    async def wait(self) -> None:
        self.waiting += 1
        try:
            while not self._open.is_set():
                await asyncio.sleep(0.01)
        finally:
            self.waiting -= 1


@dataclass
class Reply:
    pieces: list[Any]
    status: int = 200
    content_type: str = "text/event-stream"


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    received_at: float = 0.0  # time.perf_counter() when the request was read
    sent_at: list[float] = field(default_factory=list)  # just before each body chunk was written
    answered: bool = False  # the whole answer was written

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class ScriptedUpstream:
    routes: dict[tuple[str, str], Any]  # a Reply, or a function of the request's JSON body to one
    requests: list[Recorded] = field(default_factory=list)
    port: int = 0
    server: asyncio.AbstractServer | None = None
    loop: asyncio.AbstractEventLoop | None = None
    broken_writes: int = 0  # responses the client hung up on before the end

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        """Stop listening: once this returns, connections to this port are refused."""
        if self.server is not None and self.loop is not None:
            closed = threading.Event()

            def stop() -> None:
                assert self.server is not None
                self.server.close()  # closes the listening sockets at once
                closed.set()

            self.loop.call_soon_threadsafe(stop)
            assert closed.wait(60), "the upstream's event loop did not run"

    def sent(self, path: str) -> list[Any]:
        return [r.json() for r in self.requests if r.path == path]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            recorded = Recorded(method, path, headers, body, received_at=time.perf_counter())
            self.requests.append(recorded)
            reply = self.routes.get((method, path)) or Reply([b'{"error":"no such route"}'], 404, "application/json")
            if callable(reply):
                reply = reply(json.loads(body) if body else {})
            writer.write(f"HTTP/1.1 {reply.status} X\r\ncontent-type: {reply.content_type}\r\n"
                         f"transfer-encoding: chunked\r\nconnection: close\r\n\r\n".encode())
            await writer.drain()
            for piece in reply.pieces:
                if piece is CUT:
                    writer.close()
                    return
                if isinstance(piece, float):
                    await asyncio.sleep(piece)
                    continue
                if isinstance(piece, Hold):
                    await piece.wait()
                    continue
                if writer.is_closing() or reader.at_eof():
                    raise ConnectionResetError
                recorded.sent_at.append(time.perf_counter())
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            recorded.answered = True
        except ConnectionError:
            self.broken_writes += 1
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


@contextmanager
def scripted_upstream(routes: dict[tuple[str, str], Any], host: str = "127.0.0.1",
                      port: int = 0) -> Iterator[ScriptedUpstream]:
    """A scripted upstream in a thread of its own, on `host` and `port` (0: any free port)."""
    upstream = ScriptedUpstream(routes)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def serve() -> None:
        server = await asyncio.start_server(upstream._handle, host, port)
        upstream.port = server.sockets[0].getsockname()[1]
        upstream.server, upstream.loop = server, loop
        started.set()
        async with server:
            with contextlib.suppress(asyncio.CancelledError):
                await server.serve_forever()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield upstream
    finally:
        loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
        thread.join(5)


def by_stream(stream: Reply, whole: Reply):  # noqa: ANN201
    """Answer a request by its `stream` flag, as an OpenAI-compatible server does."""
    return lambda body: stream if body.get("stream") else whole


def sse(*payloads: Any, crlf: bool = False) -> bytes:
    end = b"\r\n" if crlf else b"\n"
    return b"".join(b"data: " + (p if isinstance(p, bytes) else json.dumps(p, separators=(",", ":")).encode())
                    + end + end for p in payloads)


def split_every(data: bytes, size: int) -> list[bytes]:
    """Cut a recording into network reads of `size` bytes: events split anywhere."""
    return [data[i:i + size] for i in range(0, len(data), size)]
