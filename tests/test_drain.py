"""Graceful shutdown: SIGTERM during streams lets them finish, refuses new requests with 503 and
turns /health to 503, then the process exits cleanly."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tests.recordings import openai_text_routes
from tests.server import CLIENT_TIMEOUT, PROCESSES, WAIT, running_gateway, wait_until
from tests.upstream import Hold, scripted_upstream

WORDS = "one two three four five six"


def test_sigterm_drains_streams_in_flight_and_refuses_new_requests(tmp_path: Path) -> None:
    """By order, not by the clock: both streams are held after their first word until the checks
    made during the drain are done; only then do they go on to their end."""
    hold = Hold()
    with scripted_upstream(openai_text_routes(WORDS, gap=0.05, hold=hold, hold_after=1)) as upstream:
        config = f"""
[server]
drain_timeout = {WAIT}
health_check_interval = 60
[backends.up]
type = "openai"
base_url = "{upstream.url}"
model = "m"
idle_timeout = {WAIT}
[models.m]
backend = "up"
"""
        with running_gateway(config, tmp_path) as url:
            proc = PROCESSES[url]
            texts: list[str] = ["", ""]
            started = [threading.Event(), threading.Event()]

            def stream(i: int) -> None:
                body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            started[i].set()
                            choices = json.loads(line[6:])["choices"]
                            if choices:
                                texts[i] += choices[0]["delta"].get("content") or ""
                        elif line == "data: [DONE]":
                            texts[i] += "|done"

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
            for thread in threads:
                thread.start()
            assert all(event.wait(WAIT) for event in started)  # both streams are under way...
            wait_until(lambda: hold.waiting == 2, "both streams held at the upstream")  # ...and cannot end yet
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT).status_code == 503,
                       "/health turned 503 (draining)", interval=0.1)
            assert httpx.get(f"{url}/live", timeout=CLIENT_TIMEOUT).status_code == 200  # alive, just not ready
            refused = httpx.post(f"{url}/v1/chat/completions", timeout=CLIENT_TIMEOUT,
                                 json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "service_unavailable_error"
            refused = httpx.post(f"{url}/generate", json={"inputs": "Hi"}, timeout=CLIENT_TIMEOUT)
            assert refused.status_code == 503 and refused.json()["error_type"] == "unavailable"
            assert proc.poll() is None and all(thread.is_alive() for thread in threads)  # still draining
            hold.open()
            for thread in threads:
                thread.join(WAIT)
            assert texts == [WORDS + "|done"] * 2  # both streams completed after the signal
            assert proc.wait(WAIT) == 0
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{url}/health", timeout=2)
