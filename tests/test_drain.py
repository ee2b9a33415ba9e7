"""Graceful shutdown: SIGTERM during streams lets them finish, refuses new requests with 503 and
turns /health to 503, then the process exits cleanly."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.recordings import openai_text_routes
from tests.server import PROCESSES, running_gateway
from tests.upstream import scripted_upstream

WORDS = "one two three four five six"


def test_sigterm_drains_streams_in_flight_and_refuses_new_requests(tmp_path: Path) -> None:
    with scripted_upstream(openai_text_routes(WORDS, gap=0.4)) as upstream:
        config = f"""
[server]
drain_timeout = 20
health_check_interval = 60
[backends.up]
type = "openai"
base_url = "{upstream.url}"
model = "m"
[models.m]
backend = "up"
"""
        with running_gateway(config, tmp_path) as url:
            proc = PROCESSES[url]
            texts: list[str] = ["", ""]
            started = [threading.Event(), threading.Event()]

            def stream(i: int) -> None:
                body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
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
            assert all(event.wait(10) for event in started)  # both streams are under way
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            health = httpx.get(f"{url}/health", timeout=5)
            assert health.status_code == 503
            assert httpx.get(f"{url}/live", timeout=5).status_code == 200  # alive, just not ready
            refused = httpx.post(f"{url}/v1/chat/completions", timeout=5,
                                 json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "service_unavailable_error"
            refused = httpx.post(f"{url}/generate", json={"inputs": "Hi"}, timeout=5)
            assert refused.status_code == 503 and refused.json()["error_type"] == "unavailable"
            for thread in threads:
                thread.join(30)
            assert texts == [WORDS + "|done"] * 2  # both streams completed after the signal
            assert proc.wait(20) == 0
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{url}/health", timeout=2)
