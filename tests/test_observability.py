"""Metrics, access logs and traces, checked against a known sequence of requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import CLIENT_TIMEOUT, ENGINE_CONFIG, running_gateway

MARKER = "zebra-marker-42"


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, dict]]:
    """A fresh gateway with TGI's metric names on, fed a known sequence of requests."""
    tmp = tmp_path_factory.mktemp("observed")
    config = ENGINE_CONFIG + "\n[server]\ntgi_metrics = true\n"
    with running_gateway(config, tmp) as url:
        sent = {"prompt_tokens": 0}
        for _ in range(3):
            r = httpx.post(f"{url}/generate", json={"inputs": f"Tell me about {MARKER}",
                                                    "parameters": {"max_new_tokens": 4}}, timeout=CLIENT_TIMEOUT)
            sent["prompt_tokens"] += int(r.headers["x-prompt-tokens"])
            sent["request_id"] = r.headers["x-request-id"]
        for _ in range(2):
            raw = httpx.post(f"{url}/v1/chat/completions", json={
                "model": "smollm2", "max_tokens": 3, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"Say {MARKER}"}]}, timeout=CLIENT_TIMEOUT).text
            usage = [json.loads(p[6:]) for p in raw.split("\n\n") if p.startswith("data: {")][-1]["usage"]
            sent["prompt_tokens"] += usage["prompt_tokens"]
        httpx.post(f"{url}/generate", json={"inputs": "x", "parameters": {"top_k": 0}}, timeout=CLIENT_TIMEOUT)  # a 422
        tagged = httpx.post(f"{url}/generate", headers={"x-request-id": "client-id-7"},
                            json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=CLIENT_TIMEOUT)
        sent["prompt_tokens"] += int(tagged.headers["x-prompt-tokens"])
        sent["tagged_header"] = tagged.headers["x-request-id"]
        metrics = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT)
        yield metrics.text, tmp / "server.log", sent


def samples(text: str, name: str) -> dict[tuple, float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def one(text: str, name: str, **labels: str) -> float:
    matches = [v for k, v in samples(text, name).items() if all((lk, lv) in k for lk, lv in labels.items())]
    assert len(matches) == 1, (name, labels, samples(text, name))
    return matches[0]


def test_request_counts_tokens_and_finish_reasons_match_what_was_sent(observed) -> None:
    text, _, sent = observed
    assert one(text, "llmgw_requests_total", route="/generate", status="200", finish_reason="length",
               model="smollm2", backend="local") == 4
    assert one(text, "llmgw_requests_total", route="/v1/chat/completions", status="200",
               finish_reason="length") == 2
    assert one(text, "llmgw_requests_total", route="/generate", status="422") == 1
    assert one(text, "llmgw_generation_tokens_total", model="smollm2", backend="local") == 3 * 4 + 2 * 3 + 2
    assert one(text, "llmgw_prompt_tokens_total", model="smollm2", backend="local") == sent["prompt_tokens"]
    assert one(text, "llmgw_time_to_first_token_seconds_count", model="smollm2") == 6
    assert one(text, "llmgw_e2e_request_latency_seconds_count", model="smollm2") == 6
    assert one(text, "llmgw_inter_token_latency_seconds_count", model="smollm2") == 3 * 3 + 2 * 2 + 1
    assert one(text, "llmgw_requests_in_flight", route="/generate") == 0


def test_engine_and_backend_state_are_exported(observed) -> None:
    text, _, _ = observed
    assert one(text, "llmgw_engine_kv_blocks_used", backend="local") == 0  # every block freed
    assert one(text, "llmgw_engine_kv_blocks_total", backend="local") > 0
    assert one(text, "llmgw_engine_running_seqs", backend="local") == 0
    assert one(text, "llmgw_engine_batch_size_count", backend="local") >= 6
    assert one(text, "llmgw_engine_step_seconds_count", backend="local") >= 6
    assert one(text, "llmgw_engine_preemptions_total", backend="local") == 0
    assert one(text, "llmgw_backend_healthy", backend="local") == 1
    assert "llmgw_engine_spec_decode" not in text  # no speculation configured: no such families


def test_tgi_metric_names_types_and_no_total_suffix(observed) -> None:
    text, _, _ = observed
    assert "# TYPE tgi_request_count counter\ntgi_request_count 7\n" in text
    assert "tgi_request_success 6\n" in text and 'tgi_request_failure{err="validation"} 1' in text
    assert "tgi_request_count_total" not in text
    assert "tgi_request_generated_tokens_count 6\n" in text
    assert "# TYPE tgi_request_duration histogram" in text and 'tgi_request_duration_bucket{le="0.00015"}' in text


def test_access_log_lines_carry_the_fields_and_never_the_prompt(observed) -> None:
    _, log, sent = observed
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    access = [line for line in lines if line.get("event") == "request"]
    assert len(access) == 7  # probes and the scrape are not logged
    first = access[0]
    assert {k: first[k] for k in ("method", "route", "model", "backend", "status", "finish_reason",
                                  "generated_tokens")} == {"method": "POST", "route": "/generate", "model": "smollm2",
                                                           "backend": "local", "status": 200,
                                                           "finish_reason": "length", "generated_tokens": 4}
    assert first["prompt_tokens"] > 0 and first["ttft_ms"] > 0 and first["duration_ms"] >= first["ttft_ms"]
    assert any(line["request_id"] == "client-id-7" for line in access) and sent["tagged_header"] == "client-id-7"
    assert MARKER not in log.read_text()
    assert any(line["status"] == 422 and line["route"] == "/generate" for line in access)
