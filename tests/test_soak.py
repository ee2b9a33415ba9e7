"""Soak: thousands of mixed requests against the embedded engine, through both doors, streaming and
not, with clients that leave mid-stream or mid-request and invalid requests mixed in.

Nothing may be lost (each request ends in a finish or a proper error), no KV block may leak, memory
stays flat and the server stays healthy. `LLMGW_SOAK_REQUESTS` sets the size (CI: 1200).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import socket
import time

import httpx
import psutil

from tests.server import CLIENT_TIMEOUT, PROCESSES, wait_until

REQUESTS = int(os.environ.get("LLMGW_SOAK_REQUESTS", "1200"))
CONCURRENCY = 16
CHAT = [{"role": "user", "content": "Say hi"}]


def gauge(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def generation_requests(text: str) -> float:
    routes = r'route="/(?:v1/chat/completions|v1/completions|generate|generate_stream)"'
    return sum(float(v) for v in re.findall(rf"^llmgw_requests_total{{[^}}]*{routes}[^}}]*}} (\S+)$", text, re.M))


async def one(client: httpx.AsyncClient, i: int) -> str:
    """Send request number i; the outcome's name, or 'LOST: ...' when something is wrong."""
    kind = i % 8
    tokens = 1 + i % 4
    if kind == 0:
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": tokens})
        ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        return "openai" if ok else f"LOST: {r.status_code} {r.text[:200]}"
    if kind == 1:
        finishes, done = 0, False
        async with client.stream("POST", "/v1/chat/completions",
                                 json={"messages": CHAT, "max_tokens": tokens, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    choices = json.loads(line[6:])["choices"]
                    finishes += sum(1 for c in choices if c.get("finish_reason"))
        return "openai-stream" if done and finishes == 1 else f"LOST: stream finishes={finishes} done={done}"
    if kind == 2:
        r = await client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": tokens}})
        return "tgi" if r.status_code == 200 and "generated_text" in r.json() else f"LOST: {r.text[:200]}"
    if kind == 3:
        last = None
        async with client.stream("POST", "/generate_stream",
                                 json={"inputs": "Hi", "parameters": {"max_new_tokens": tokens}}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    last = json.loads(line[5:])
        return "tgi-stream" if last and last.get("generated_text") is not None else f"LOST: {last}"
    if kind == 4:  # leaves after the first event of a long stream
        async with client.stream("POST", "/generate_stream",
                                 json={"inputs": "Tell a story", "parameters": {"max_new_tokens": 200}}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break
        return "left-mid-stream"
    if kind == 5:  # gives up on a long non-streaming answer (only the wait for it is short: it is sent)
        try:
            await client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 200},
                              timeout=httpx.Timeout(CLIENT_TIMEOUT, read=0.3))
        except httpx.TimeoutException:
            return "left-mid-request"
        return "left-mid-request (answered first)"
    if kind == 6:
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "temperature": -1})
        ok = r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        return "openai-invalid" if ok else f"LOST: {r.status_code} {r.text[:200]}"
    r = await client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 0}})
    ok = r.status_code == 422 and set(r.json()) == {"error", "error_type"}
    return "tgi-invalid" if ok else f"LOST: {r.status_code} {r.text[:200]}"


async def soak(url: str, process: psutil.Process) -> tuple[collections.Counter[str], list[float]]:
    outcomes: collections.Counter[str] = collections.Counter()
    memory: list[float] = []
    queue = iter(range(REQUESTS))
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT, limits=limits) as client:
        async def worker() -> None:
            for i in queue:
                try:
                    outcomes[await one(client, i)] += 1
                except httpx.HTTPError as exc:
                    outcomes[f"LOST: {type(exc).__name__}: {exc}"] += 1
                if i % (REQUESTS // 8) == 0:
                    memory.append(process.memory_info().rss / 2**20)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return outcomes, memory


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text


def idle_metrics(url: str) -> str | None:
    """The metrics once the engine is idle: no block used, nothing running or waiting."""
    text = metrics(url)
    idle = all(gauge(text, name) == 0 for name in ("llmgw_engine_kv_blocks_used", "llmgw_engine_running_seqs",
                                                   "llmgw_engine_waiting_seqs"))
    return text if idle else None


def aborted_and_idle(url: str, before: str, aborts: int) -> str | None:
    """The metrics once the engine is idle and has counted `aborts` more aborts than in `before`. The abort is
    counted just after its blocks are freed, in the engine's thread, so a scrape can fall between the two."""
    text = idle_metrics(url)
    if text is None:
        return None
    counted = gauge(text, "llmgw_abort_seconds_count") - gauge(before, "llmgw_abort_seconds_count")
    return text if counted >= aborts else None


def test_soak_loses_nothing_leaks_nothing_and_stays_healthy(gateway_url: str) -> None:
    process = psutil.Process(PROCESSES[gateway_url].pid)
    before = metrics(gateway_url)
    started = time.monotonic()
    outcomes, memory = asyncio.run(soak(gateway_url, process))
    print(f"\nsoak: {REQUESTS} requests in {time.monotonic() - started:.0f} s; outcomes {dict(outcomes)}; "
          f"server RSS MB at each eighth: {[round(m) for m in memory]}")
    lost = {k: v for k, v in outcomes.items() if k.startswith("LOST")}
    assert not lost, lost
    assert sum(outcomes.values()) == REQUESTS
    assert outcomes["left-mid-stream"] == REQUESTS // 8 and outcomes["openai-stream"] >= REQUESTS // 8

    # the end state, not how long it took: every block free, nothing running or waiting (how soon an abort
    # frees its blocks is counted in engine steps, below and in test_async_engine)
    after = wait_until(lambda: aborted_and_idle(gateway_url, before, REQUESTS // 8),
                       "the engine idle, blocks free, each client that left mid-stream aborted")
    assert gauge(after, "llmgw_engine_kv_blocks_used") == 0 and gauge(after, "llmgw_engine_kv_blocks_total") > 0
    assert httpx.get(f"{gateway_url}/health", timeout=CLIENT_TIMEOUT).status_code == 200
    # every request was seen through to an answer (or the client's leaving) by the server
    assert generation_requests(after) - generation_requests(before) == REQUESTS
    aborts = gauge(after, "llmgw_abort_seconds_count") - gauge(before, "llmgw_abort_seconds_count")
    assert aborts >= REQUESTS // 8  # at least every client that left mid-stream: the engine freed each one
    # memory: flat after warm-up (the first sample includes the first requests' allocations)
    assert max(memory[2:]) - memory[2] < 64, memory


def test_a_client_leaving_a_stream_frees_its_blocks_within_engine_steps(gateway_url: str) -> None:
    """Counted in engine steps, not seconds: a stream asked for many tokens (and to ignore EOS), left
    after its first, stops far short of them. The engine is otherwise idle, so each step it takes
    in the meantime is this request's."""
    asked = 1000
    before = wait_until(lambda: idle_metrics(gateway_url), "the engine idle")
    body = {"prompt": "Once upon a time", "max_tokens": asked, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{gateway_url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token, then hang up
    after = wait_until(lambda: aborted_and_idle(gateway_url, before, 1), "the request aborted, its blocks freed")
    steps = gauge(after, "llmgw_engine_step_seconds_count") - gauge(before, "llmgw_engine_step_seconds_count")
    print(f"\nleft after one token of {asked}: {steps:.0f} engine steps in all")
    assert gauge(after, "llmgw_abort_seconds_count") - gauge(before, "llmgw_abort_seconds_count") == 1
    assert 1 <= steps < asked // 2, steps  # aborted, not run to its end: its blocks freed within a few steps


def test_a_client_leaving_before_a_whole_answer_frees_its_blocks_within_engine_steps(gateway_url: str) -> None:
    """The non-streaming twin: the client hangs up while its whole answer is being generated; the gateway
    sees the disconnect and aborts the engine request, far short of the tokens asked for."""
    asked = 1000
    before = wait_until(lambda: idle_metrics(gateway_url), "the engine idle")
    host, port = gateway_url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": asked, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: gauge(metrics(gateway_url), "llmgw_engine_running_seqs") >= 1, "the request running")
    after = wait_until(lambda: aborted_and_idle(gateway_url, before, 1), "the request aborted, its blocks freed")
    steps = gauge(after, "llmgw_engine_step_seconds_count") - gauge(before, "llmgw_engine_step_seconds_count")
    assert gauge(after, "llmgw_abort_seconds_count") - gauge(before, "llmgw_abort_seconds_count") == 1
    assert 1 <= steps < asked // 2, steps
