"""`llmgw bench`: its figures against a server with scripted timings, and against the real gateway."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

from llmgw_bench.api import RequestResult
from llmgw_bench.metrics import parse_slo, summarize
from llmgw_bench.runner import arrival_times
from llmgw_bench.workload import local_counter, random_samples
from tests.server import PROCESSES, ROOT, WAIT
from tests.upstream import CUT, Reply, scripted_upstream, sse

FIRST, GAP, TOKENS = 0.25, 0.03, 12  # the scripted server: first token after FIRST s, then one every GAP s


def llmgw_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", "bench", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=5 * WAIT)


def timed_stream(api: str) -> Reply:
    """TOKENS tokens: the first after FIRST seconds, the others GAP apart; usage as the server reports it."""
    pieces: list[Any] = [FIRST]
    for i in range(TOKENS):
        if i:
            pieces.append(GAP)
        last = i == TOKENS - 1
        if api == "tgi":
            event = {"index": i + 1, "token": {"id": 7, "text": " w", "logprob": -0.1, "special": False},
                     "generated_text": " w" * TOKENS if last else None,
                     "details": {"finish_reason": "length", "generated_tokens": TOKENS, "seed": None} if last else None}
        elif api == "openai-chat":
            event = {"choices": [{"index": 0, "delta": {"content": " w"}, "finish_reason": "length" if last else None}]}
        else:
            event = {"choices": [{"index": 0, "text": " w", "finish_reason": "length" if last else None}]}
        pieces.append(sse(event))
    if api != "tgi":
        pieces.append(sse({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": TOKENS}}, b"[DONE]"))
    return Reply(pieces)


ROUTES = {("POST", "/v1/chat/completions"): timed_stream("openai-chat"),
          ("POST", "/v1/completions"): timed_stream("openai-completions"),
          ("POST", "/generate_stream"): timed_stream("tgi")}


def most_at_once(requests: list[dict[str, Any]]) -> int:
    """The most requests in flight at one moment, from each one's start and latency."""
    events = sorted([(r["start"] + r["latency"], -1) for r in requests] + [(r["start"], 1) for r in requests])
    return max(itertools.accumulate(change for _, change in events))


@pytest.mark.parametrize("api", ["openai-chat", "openai-completions", "tgi"])
def test_reported_timings_match_a_scripted_server(api: str, smollm_dir: Path, tmp_path: Path) -> None:
    """By order and count, not against the clock (sleeps overshoot on a busy machine, by any amount):
    no figure is shorter than what the scripted server itself took, every request lies within the run,
    at most four at once, and the figures agree with one another."""
    out = tmp_path / "result.json"
    with scripted_upstream(ROUTES) as upstream:
        began = time.perf_counter()
        done = llmgw_bench("--url", upstream.url, "--api", api, "--model", "m", "--tokenizer", str(smollm_dir),
                           "--input-len", "20", "--output-len", str(TOKENS), "--num-requests", "12",
                           "--concurrency", "4", "--warmup", "0", "--no-metrics", "--no-plots", "--no-progress",
                           "--output", str(out))
        wall = time.perf_counter() - began
        assert done.returncode == 0, done.stderr
        assert len(upstream.requests) == 12
        served = upstream.requests
    run = json.loads(out.read_text())["runs"][0]
    summary, requests = run["summary"], run["requests"]
    assert summary["completed"] == 12 and summary["errors"] == {}
    assert {(r["output_tokens"], r["output_tokens_from"]) for r in requests} == {
        (TOKENS, "details" if api == "tgi" else "usage")}
    # the server's own record of each request: read, then its first and last token written. A client can
    # see neither token before it was written: matched in order of size, no figure is shorter
    server_ttft = sorted(r.sent_at[0] - r.received_at for r in served)
    server_e2el = sorted(r.sent_at[TOKENS - 1] - r.received_at for r in served)
    assert all(ours >= theirs for ours, theirs in zip(sorted(r["ttft"] for r in requests), server_ttft, strict=True))
    assert all(ours >= theirs for ours, theirs in zip(sorted(r["latency"] for r in requests), server_e2el,
                                                      strict=True))
    # every request within the run, which the bench's process outlasted; four workers, so four at once at most
    assert summary["duration_s"] <= wall
    for r in requests:
        assert 0 <= r["start"] and 0 < r["ttft"] <= r["latency"]
        assert r["start"] + r["latency"] <= summary["duration_s"] + 1e-9
    assert most_at_once(requests) <= 4
    assert sum(r["latency"] for r in requests) <= 4 * summary["duration_s"] + 1e-9
    # the figures agree: TTFT and the gaps make the latency; TPOT and ITL are their means
    for r in requests:
        assert len(r["itl"]) == TOKENS - 1 and r["ttft"] + sum(r["itl"]) == pytest.approx(r["latency"])
    gaps = [gap for r in requests for gap in r["itl"]]
    assert len(gaps) == 12 * (TOKENS - 1)  # ITL pools every gap
    assert summary["itl_s"]["mean"] == pytest.approx(sum(gaps) / len(gaps))
    assert summary["tpot_s"]["mean"] == pytest.approx(sum((r["latency"] - r["ttft"]) / (TOKENS - 1)
                                                          for r in requests) / 12)
    for name, key in (("ttft_s", "ttft"), ("e2el_s", "latency")):
        values = [r[key] for r in requests]
        assert min(values) <= summary[name]["p50"] <= max(values)
        assert summary[name]["mean"] == pytest.approx(sum(values) / 12)
    assert summary["output_throughput"] == pytest.approx(12 * TOKENS / summary["duration_s"])


def test_failures_are_counted_by_kind(smollm_dir: Path, tmp_path: Path) -> None:
    calls = iter(range(1000))
    good = timed_stream("openai-completions")

    def answer(_body: dict[str, Any]) -> Reply:
        kind = next(calls) % 5
        if kind == 1:
            return Reply([b'{"error": {"message": "busy"}}'], 429, "application/json")
        if kind == 2:
            return Reply([sse({"choices": [{"index": 0, "text": " w", "finish_reason": None}]}), CUT])
        if kind == 3:
            return Reply([sse({"error": {"message": "engine died", "type": "internal"}})])
        if kind == 4:  # a clean end of stream, but no finish_reason
            return Reply([sse({"choices": [{"index": 0, "text": " w", "finish_reason": None}]}, b"[DONE]")])
        return good

    out = tmp_path / "result.json"
    with scripted_upstream({("POST", "/v1/completions"): answer}) as upstream:
        done = llmgw_bench("--url", upstream.url, "--api", "openai-completions", "--model", "m", "--tokenizer",
                           str(smollm_dir), "--input-len", "8", "--output-len", str(TOKENS), "--num-requests", "10",
                           "--concurrency", "1", "--warmup", "0", "--no-metrics", "--no-plots", "--no-progress",
                           "--output", str(out))
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    assert summary["completed"] == 2
    assert summary["errors"] == {"http_429": 2, "disconnected": 2, "stream_error": 2, "incomplete": 2}
    assert "Errors by kind" in done.stdout


def test_gateway_run_counts_tokens_as_the_server_does(gateway_url: str, tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    done = llmgw_bench("--url", gateway_url, "--api", "openai-completions", "--tokenizer", "server",
                       "--input-len", "24", "--output-len", "8", "--ignore-eos", "--num-requests", "6",
                       "--concurrency", "1,3", "--pid", str(PROCESSES[gateway_url].pid), "--sample-interval", "0.1",
                       "--no-progress", "--output", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert [run["label"] for run in result["runs"]] == ["c=1", "c=3"]
    for run in result["runs"]:
        for request in run["requests"]:
            assert request["ok"] and request["output_tokens_from"] == "usage"
            assert request["output_tokens"] == 8  # ignore_eos: exactly --output-len
            assert request["prompt_tokens"] == request["input_len"] == 24  # exact prompt lengths
            assert 0 < request["ttft"] <= request["latency"]
        assert run["summary"]["total_output_tokens"] == 6 * 8
        samples = run["resources"]["samples"]
        assert samples and all(s["cpu_percent"] >= 0 and s["rss_mb"] > 100 for s in samples)
        assert any({"kv_cache_usage", "running", "waiting"} <= set(s) for s in samples)  # the server's gauges
    plots = tmp_path / "engine-plots"
    for name in ("latency_cdf.png", "sweep.png", "resources.png"):
        image = matplotlib.image.imread(plots / name)
        assert image.shape[0] > 100 and image.shape[1] > 100
    assert "Output token throughput (tok/s)" in done.stdout

    tgi = tmp_path / "tgi.json"
    done = llmgw_bench("--url", gateway_url, "--api", "tgi", "--tokenizer", "server", "--input-len", "24",
                       "--output-len", "8", "--num-requests", "3", "--concurrency", "3", "--no-progress",
                       "--no-plots", "--output", str(tgi))
    assert done.returncode == 0, done.stderr
    for request in json.loads(tgi.read_text())["runs"][0]["requests"]:
        assert request["output_tokens_from"] == "details"
        assert request["output_tokens"] == request["chunks"]  # one TGI event per token

    compared = llmgw_bench("compare", str(out), str(tgi), "--plots-dir", str(tmp_path / "ab"))
    assert compared.returncode == 0, compared.stderr
    assert "B/A" in compared.stdout and "c=3" in compared.stdout and "c=1" not in compared.stdout
    assert matplotlib.image.imread(tmp_path / "ab" / "latency_cdf.png").shape[0] > 100


def test_random_prompts_have_exact_token_counts_and_repeat_by_seed(smollm_dir: Path) -> None:
    counter = local_counter(str(smollm_dir))
    samples = random_samples(counter, 5, 50, 16, range_ratio=0.2, prefix_len=10, seed=3)
    assert all(40 <= s.input_len <= 60 + 10 and counter(s.prompt) == s.input_len for s in samples)
    assert all(12 <= s.output_len <= 19 for s in samples)
    assert len({s.prompt.split()[0] for s in samples}) == 1  # the shared prefix
    assert samples == random_samples(counter, 5, 50, 16, range_ratio=0.2, prefix_len=10, seed=3)
    assert samples != random_samples(counter, 5, 50, 16, range_ratio=0.2, prefix_len=10, seed=4)
    exact = random_samples(counter, 4, 37, 8, seed=1)
    assert [s.input_len for s in exact] == [37] * 4


def test_metrics_follow_vllm_definitions() -> None:
    def request(ttft: float, gaps: list[float], tokens: int, ok: bool = True) -> RequestResult:
        return RequestResult(0.0, 10, ok=ok, error=None if ok else "timeout", ttft=ttft, itl=gaps,
                             latency=ttft + sum(gaps), output_tokens=tokens)

    results = [request(0.1, [0.02, 0.04], 3), request(0.3, [0.1], 2), request(0.2, [], 1),
               request(0.0, [], 0, ok=False)]
    summary = summarize(results, duration=2.0, slo=parse_slo("ttft=250ms,tpot=0.05s"))
    assert summary["completed"] == 3 and summary["errors"] == {"timeout": 1}
    assert summary["tpot_s"]["mean"] == pytest.approx((0.03 + 0.1) / 2)  # the one-token answer has no TPOT
    assert summary["itl_s"]["mean"] == pytest.approx((0.02 + 0.04 + 0.1) / 3)  # gaps pooled
    assert summary["output_throughput"] == pytest.approx(6 / 2.0)
    assert summary["total_token_throughput"] == pytest.approx((30 + 6) / 2.0)
    assert summary["good_requests"] == 2  # the second misses both SLOs
    assert summary["goodput"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        parse_slo("latency=5")


def test_poisson_arrivals_end_at_n_over_rate_and_repeat_by_seed() -> None:
    times = arrival_times(400, 20.0, 1.0, seed=0)
    assert times[-1] == pytest.approx(400 / 20.0)
    assert times == sorted(times) and times == arrival_times(400, 20.0, 1.0, seed=0)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert 0.8 < cv < 1.2  # exponential gaps: coefficient of variation 1
    bursty = arrival_times(400, 20.0, 0.25, seed=0)
    bursty_gaps = [b - a for a, b in zip([0.0, *bursty], bursty)]
    bursty_mean = sum(bursty_gaps) / len(bursty_gaps)
    assert (sum((g - bursty_mean) ** 2 for g in bursty_gaps) / len(bursty_gaps)) ** 0.5 / bursty_mean > 1.5


def test_sharegpt_and_prompt_files_become_samples(smollm_dir: Path, tmp_path: Path) -> None:
    from llmgw_bench.workload import prompt_file_samples, sharegpt_samples

    counter = local_counter(str(smollm_dir))
    long_answer = "word " * 3000  # over vLLM's 2048-token total: filtered out
    conversations = [
        {"conversations": [{"from": "human", "value": "Tell me about the sea and its tides."},
                           {"from": "gpt", "value": "The sea rises and falls twice a day, pulled by the moon."}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, friend."}]},
        {"conversations": [{"from": "human", "value": "Write a very long essay please."},
                           {"from": "gpt", "value": long_answer}]},
        {"conversations": [{"from": "human", "value": "Only a question, no answer"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    samples = sharegpt_samples(path, counter, 10, seed=0)
    assert [s.prompt for s in samples] == ["Tell me about the sea and its tides."]  # "Hi" is under 4 tokens
    assert samples[0].output_len == counter(conversations[0]["conversations"][1]["value"])
    assert sharegpt_samples(path, counter, 10, output_len=7)[0].output_len == 7

    lines = tmp_path / "prompts.txt"
    lines.write_text("first prompt here\n\nsecond one\n")
    assert [(s.prompt, s.output_len) for s in prompt_file_samples(lines, counter, 12)] == [
        ("first prompt here", 12), ("second one", 12)]
    records = tmp_path / "prompts.jsonl"
    records.write_text('{"prompt": "a question", "output_len": 5}\n{"prompt": "another"}\n')
    got = prompt_file_samples(records, counter, 12)
    assert [(s.prompt, s.output_len, s.input_len) for s in got] == [
        ("a question", 5, counter("a question")), ("another", 12, counter("another"))]
