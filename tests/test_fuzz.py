"""Fuzzing: schemathesis generates valid and invalid requests for every route of the gateway's own
OpenAPI document (Litestar's) and sends them to a real server process with a tiny model; no answer
may be a 5xx, and every error keeps its protocol's shape. `LLMGW_FUZZ_EXAMPLES` sets the examples
per route and mode (CI: 50)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from gateway.app import create_app
from gateway.config import parse_config
from tests.server import CLIENT_TIMEOUT, running_gateway

EXAMPLES = int(os.environ.get("LLMGW_FUZZ_EXAMPLES", "50"))


def _schema() -> schemathesis.BaseSchema:
    """The OpenAPI document as the server publishes it at /docs/openapi.json (it does not depend on
    the backends, so a placeholder config serves to build it at collection time)."""
    config = parse_config('[backends.b]\ntype = "openai"\nbase_url = "http://127.0.0.1:9"\nmodel = "m"\n'
                          '[models.m]\nbackend = "b"\n')
    return schemathesis.openapi.from_dict(create_app(config).openapi_schema.to_schema())


SCHEMA = _schema()
OPERATIONS = {op.label: op for op in (result.ok() for result in SCHEMA.get_all_operations())}
# (label, mode): invalid input only exists where there is a body or a parameter to get wrong
CASES = [(label, GenerationMode.POSITIVE) for label in sorted(OPERATIONS)] + [
    (label, GenerationMode.NEGATIVE) for label, op in sorted(OPERATIONS.items())
    if len(op.body) or list(op.iter_parameters())]


@pytest.fixture(scope="module")
def fuzz_url(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = f"""
[server]
health_check_interval = 60
admin_key = "fuzz-admin-key"
[backends.tiny]
type = "engine"
model = "{tiny_llama_dir}"
kv_cache_mb = 64
[models.tiny]
backend = "tiny"
max_input_tokens = 512
max_total_tokens = 1024
max_new_tokens = 16
"""
    with running_gateway(config, tmp_path_factory.mktemp("fuzz")) as url:
        yield url


def test_the_schema_covers_both_doors() -> None:
    assert {"POST /generate", "POST /generate_stream", "POST /v1/chat/completions", "POST /v1/completions",
            "GET /health", "GET /metrics"} <= set(OPERATIONS)


@pytest.mark.parametrize(("label", "mode"), CASES, ids=[f"{label}-{mode.value}" for label, mode in CASES])
def test_no_route_answers_5xx_and_errors_keep_the_protocol_shape(fuzz_url: str, label: str,
                                                                 mode: GenerationMode) -> None:
    operation = OPERATIONS[label]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case: schemathesis.Case) -> None:
        response = case.call(base_url=fuzz_url, timeout=CLIENT_TIMEOUT)
        assert response.status_code < 500 or (response.status_code == 503 and case.path == "/health"), \
            f"{label}: {response.status_code} {response.text[:500]}"
        if response.status_code < 400:
            return
        body = response.json()
        if case.path.startswith("/v1/messages"):  # Anthropic's door keeps Anthropic's shape
            assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}, body
        elif case.path.startswith("/v1/"):
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        else:
            assert set(body) == {"error", "error_type"}, body

    check()
