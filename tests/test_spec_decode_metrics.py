"""Speculative decoding's counters on /metrics (from an engine worker process) and in `llmgw bench`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw_bench.resources import parse_spec_counters
from tests.server import CLIENT_TIMEOUT, ENGINE_CONFIG, running_gateway
from tests.test_bench import llmgw_bench

K = 4
SPEC_CONFIG = ENGINE_CONFIG + f"""
[backends.local.speculative]
method = "ngram"
num_speculative_tokens = {K}
prompt_lookup_min = 2
"""
NUMBERS = ", ".join(str(i) for i in range(1, 41))
PROMPT = f"Count: {NUMBERS}.\nCount again: {NUMBERS}.\nCount once more: 1, 2, 3,"  # the answer repeats the prompt
PREFIX = "llmgw_engine_spec_decode_"


@pytest.fixture(scope="module")
def spec_gateway(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Iterator[str]:
    """A gateway whose engine (a worker process, the default) drafts by n-gram prompt lookup."""
    with running_gateway(SPEC_CONFIG, tmp_path_factory.mktemp("spec")) as url:
        yield url


def spec_samples(url: str) -> dict[str, dict[tuple, float]]:
    """Every spec_decode sample on /metrics: name (without the prefix) -> labels -> value."""
    found: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text):
        for sample in family.samples:
            if sample.name.startswith(PREFIX):
                found.setdefault(sample.name.removeprefix(PREFIX), {})[tuple(sorted(sample.labels.items()))] = \
                    sample.value
    return found


def only(found: dict[str, dict[tuple, float]], name: str) -> float:
    values = found[name]
    assert list(values) == [(("backend", "local"), ("method", "ngram"))], values
    return next(iter(values.values()))


def complete(url: str, prompt: str) -> dict:
    response = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 48,
                                                         "temperature": 0}, timeout=CLIENT_TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def test_counters_of_a_repeating_completion_are_exported_per_backend_and_method(spec_gateway: str) -> None:
    before = spec_samples(spec_gateway)
    assert only(before, "num_draft_tokens_total") == 0  # exported from the start, before any draft
    assert complete(spec_gateway, PROMPT)["usage"]["completion_tokens"] > 0
    found = spec_samples(spec_gateway)  # the worker's figures reach the gateway before the request's last token
    drafts, drafted = only(found, "num_drafts_total"), only(found, "num_draft_tokens_total")
    accepted, emitted = only(found, "num_accepted_tokens_total"), only(found, "num_emitted_tokens_total")
    assert drafted > 0 and 0 < drafts <= drafted <= K * drafts
    assert accepted <= drafted
    assert emitted == accepted + drafts  # each verify pass emits its accepted drafts and one token more
    assert 1 <= only(found, "mean_acceptance_length") == 1 + accepted / drafts <= K + 1
    per_pos = found["num_accepted_tokens_per_pos_total"]
    by_position = [per_pos[(("backend", "local"), ("method", "ngram"), ("position", str(i)))] for i in range(K)]
    assert sum(by_position) == accepted  # a pass that accepted n drafts counts at positions 0 .. n-1
    assert by_position == sorted(by_position, reverse=True) and by_position[0] <= drafts


def test_bench_reports_the_acceptance_of_its_measured_requests(spec_gateway: str, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT.replace("\n", " ") + "\n")
    out = tmp_path / "spec.json"
    before = parse_spec_counters(httpx.get(f"{spec_gateway}/metrics", timeout=CLIENT_TIMEOUT).text)
    done = llmgw_bench("--url", spec_gateway, "--api", "openai-completions", "--model", "smollm2",
                       "--dataset", "prompts", "--dataset-path", str(prompts), "--tokenizer", "server",
                       "--output-len", "48", "--num-requests", "2", "--concurrency", "1", "--warmup", "1",
                       "--no-plots", "--no-progress", "--output", str(out))
    assert done.returncode == 0, done.stderr
    after = parse_spec_counters(httpx.get(f"{spec_gateway}/metrics", timeout=CLIENT_TIMEOUT).text)
    spec = json.loads(out.read_text())["runs"][0]["summary"]["spec_decode"]
    assert 0 < spec["drafts"] <= spec["draft_tokens"] and spec["accepted_tokens"] <= spec["draft_tokens"]
    # the warm-up request drafted too, and is left out
    assert spec["draft_tokens"] < after["draft_tokens"] - before["draft_tokens"]
    assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["draft_tokens"]
    assert 1 <= spec["mean_acceptance_length"] == 1 + spec["accepted_tokens"] / spec["drafts"] <= K + 1
    assert "Spec decode acceptance rate" in done.stdout and "Spec decode mean acceptance length" in done.stdout
