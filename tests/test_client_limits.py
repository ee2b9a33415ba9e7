"""Client limits (body size, a body sent too slowly, a client that stops reading), through the guarded
gateway of tests/guarded_gateway.py."""

from __future__ import annotations

import json
import re
import socket

from tests import guarded_gateway
from tests.guarded_gateway import CHAT, KEY_OPS, OPS, get, openai_error, post, tgi_error
from tests.server import CLIENT_TIMEOUT, wait_until
from tests.upstream import ScriptedUpstream

guarded = guarded_gateway.guarded  # the module-scoped fixture: a gateway of this module's own


def test_oversized_body_gets_413_in_the_protocols_shape(guarded: tuple) -> None:
    url, _, _ = guarded
    big = "x" * 30_000
    r = post(f"{url}/v1/chat/completions", headers=OPS,
             json={"model": "open", "messages": [{"role": "user", "content": big}]})
    assert r.status_code == 413 and openai_error(r)["type"] == "invalid_request_error"
    r = post(f"{url}/generate", headers=OPS, json={"inputs": big})
    assert r.status_code == 413 and tgi_error(r)["error_type"] == "payload_too_large"


def body_length(answer: bytes) -> int:
    head = answer.split(b"\r\n\r\n", 1)[0].decode().lower()
    return next((int(line.split(":", 1)[1]) for line in head.split("\r\n") if line.startswith("content-length:")), 0)


def read_answer(conn: socket.socket) -> str:
    """One whole HTTP answer, however the network splits it (head and body may come in separate reads)."""
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < body_length(answer):
        chunk = conn.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer.decode()


def test_a_client_that_sends_its_body_too_slowly_is_cut_off_with_408(guarded: tuple) -> None:
    url, _, _ = guarded
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=CLIENT_TIMEOUT) as conn:
        conn.sendall(f"POST /generate HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY_OPS}\r\n"
                     "content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"inp".encode())
        answer = read_answer(conn)  # the rest of the body never comes: only body_timeout answers this
    assert answer.startswith("HTTP/1.1 408")
    assert json.loads(answer.split("\r\n\r\n", 1)[1])["error_type"] == "request_timeout"


def test_a_client_that_stops_reading_is_cut_off_and_its_request_freed(guarded: tuple) -> None:
    url, upstreams, log = guarded
    firehose: ScriptedUpstream = upstreams["firehose"]
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "firehose", "stream": True, **CHAT}).encode()
    with socket.socket() as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.connect((host, int(port)))
        conn.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY_OPS}\r\n"
                     f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
        # streaming into a client that reads nothing: the request reached the upstream, which streams on
        wait_until(lambda: any(r.path == "/v1/chat/completions" for r in firehose.requests), "the upstream called")
        wait_until(lambda: in_flight(url) == 0, "the request freed (send_timeout is 1 s)", interval=0.2)
        # ...while the client still holds its socket open, and never read the stream's end
        assert not any(r.answered for r in firehose.requests if r.path == "/v1/chat/completions")
    # the stream's cleanup ran (it gives back the admission, then closes the upstream request, which the
    # upstream notices at its next write)
    wait_until(lambda: firehose.broken_writes >= 1, "the upstream request closed")
    assert "client stopped reading" in log.read_text() and "Exception in ASGI application" not in log.read_text()


def in_flight(url: str) -> float:
    text = get(f"{url}/metrics", headers=OPS).text
    found = re.search(r'^llmgw_requests_in_flight{route="/v1/chat/completions"} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0
