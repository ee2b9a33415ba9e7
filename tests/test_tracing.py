"""Traces, in process with an in-memory exporter: the span tree, GenAI attributes, and the trace
id carried from the client's traceparent through to a remote backend."""

from __future__ import annotations

import asyncio
import time

import pytest
from litestar.testing import AsyncTestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.app import create_app
from gateway.config import parse_config
from tests.recordings import openai_text_routes
from tests.server import START_TIMEOUT
from tests.upstream import scripted_upstream

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


async def test_span_tree_attributes_and_propagation() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with scripted_upstream(openai_text_routes("Hello from afar")) as upstream:
        config = parse_config(f"""
[backends.local]
type = "engine"
dtype = "float32"
kv_cache_mb = 64

[backends.remote]
type = "openai"
base_url = "{upstream.url}"
model = "m"

[models.smollm2]
backend = "local"

[models.far]
backend = "remote"
""")
        app = create_app(config, tracer_provider=provider)
        async with AsyncTestClient(app) as client:
            deadline = time.monotonic() + START_TIMEOUT  # the engine loads (the first time, converts) meanwhile
            while (await client.get("/health")).status_code != 200:
                assert time.monotonic() < deadline, "the engine never became healthy"
                await asyncio.sleep(0.1)
            exporter.clear()
            r = await client.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT}, json={
                "model": "smollm2", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200
            spans = {s.name: s for s in exporter.get_finished_spans()}
            root = spans["POST /v1/chat/completions"]
            assert format(root.context.trace_id, "032x") == TRACE_ID
            assert format(root.parent.span_id, "016x") == PARENT_ID  # the client's span is our parent
            attrs = root.attributes
            assert attrs["gen_ai.request.model"] == "smollm2" and attrs["gen_ai.operation.name"] == "chat"
            assert attrs["gen_ai.usage.output_tokens"] == 4 and attrs["gen_ai.usage.input_tokens"] > 0
            assert attrs["gen_ai.response.finish_reasons"] == ("length",) and attrs["gen_ai.request.max_tokens"] == 4
            backend = spans["backend local"]
            assert spans["route"].parent.span_id == root.context.span_id
            assert backend.parent.span_id == root.context.span_id
            for name in ("queue", "prefill", "decode"):
                assert spans[name].parent.span_id == backend.context.span_id
                assert spans[name].end_time >= spans[name].start_time
            assert spans["queue"].end_time <= spans["decode"].start_time
            assert {s.context.trace_id for s in spans.values()} == {root.context.trace_id}

            exporter.clear()
            r = await client.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT}, json={
                "model": "far", "messages": [{"role": "user", "content": "Hi"}]})
            assert r.json()["choices"][0]["message"]["content"] == "Hello from afar"
            remote_span = {s.name: s for s in exporter.get_finished_spans()}["backend remote"]
            forwarded = upstream.requests[-1].headers["traceparent"]
            _, trace_id, parent_id, _ = forwarded.split("-")
            assert trace_id == TRACE_ID and parent_id == format(remote_span.context.span_id, "016x")


def test_tracing_is_off_by_default() -> None:
    from gateway.telemetry.tracing import Tracing

    assert Tracing().enabled is False


@pytest.mark.parametrize("exporter", ["console"])
def test_exporter_is_chosen_in_config(exporter: str) -> None:
    config = parse_config(f'[server]\ntraces = "{exporter}"\n[backends.a]\ntype = "engine"\n'
                          '[models.m]\nbackend = "a"\n')
    from gateway.telemetry.tracing import Tracing

    assert Tracing(config.server.traces).enabled
