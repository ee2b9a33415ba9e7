"""A minimal, fast OpenAI-compatible upstream that answers at once (for measuring gateway overhead).

Raw asyncio with keep-alive, so the upstream costs next to nothing and what is measured is the
proxy in front of it. Chat completions, streaming (a role chunk, N content chunks, usage, [DONE])
or not, and /v1/models.

    python benchmarks/mock_openai.py --port 9100 [--chunks 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None


def build_responses(chunks: int) -> tuple[bytes, bytes, bytes]:
    words = [f" word{i}" for i in range(chunks)]
    usage = {"prompt_tokens": 12, "completion_tokens": chunks, "total_tokens": 12 + chunks}
    whole = json.dumps({
        "id": "chatcmpl-mock", "object": "chat.completion", "created": 1, "model": "mock",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)}, "logprobs": None,
                     "finish_reason": "stop"}], "usage": usage}).encode()
    base = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": "mock"}
    events = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    events += [{**base, "choices": [{"index": 0, "delta": {"content": w},
                                     "finish_reason": "stop" if i == chunks - 1 else None}]}
               for i, w in enumerate(words)]
    events.append({**base, "choices": [], "usage": usage})
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    models = json.dumps({"object": "list", "data": [{"id": "mock", "object": "model"}]}).encode()
    return whole, stream, models


def chunked(content_type: str, body: bytes) -> bytes:
    """A streamed answer as servers send one (vLLM's, OpenAI's): chunked, here all in one chunk."""
    return (f"HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n"
            f"connection: keep-alive\r\n\r\n{len(body):x}\r\n").encode() + body + b"\r\n0\r\n\r\n"


def response(status: str, content_type: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
            f"connection: keep-alive\r\n\r\n").encode() + body


async def main(port: int, chunks: int) -> None:
    whole, stream, models = build_responses(chunks)
    answers = {
        "whole": response("200 OK", "application/json", whole),
        "stream": chunked("text/event-stream", stream),
        "models": response("200 OK", "application/json", models),
        "missing": response("404 Not Found", "application/json", b'{"error":"not found"}'),
    }

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, _, rest = head.partition(b"\r\n")
                length = 0
                for line in rest.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                body = await reader.readexactly(length) if length else b""
                path = request_line.split(b" ")[1]
                if path.endswith(b"/chat/completions"):
                    key = "stream" if b'"stream":true' in body.replace(b" ", b"") else "whole"
                elif path.endswith(b"/models"):
                    key = "models"
                else:
                    key = "missing"
                writer.write(answers[key])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args()
    if uvloop is not None:
        uvloop.install()
    asyncio.run(main(args.port, args.chunks))
