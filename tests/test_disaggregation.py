"""Prefill/decode disaggregation through a real gateway (backends/pool/disaggregated.py): two engine worker
processes, one prefill and one decode, serve the same greedy text as one engine; prompts above the split
threshold go through a KV handover, shorter ones stay on the decode worker; whatever ends a request (its finish,
the client leaving, an error, a killed worker), every block on both workers is free again."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_core.kv.transfer import PREFIX, transfer_dir
from tests.server import CLIENT_TIMEOUT, ENGINE_CONFIG, running_gateway, wait_until
from tests.test_engine_worker import engine_greedy as colocated  # one engine's answer: the reference
from tests.test_engine_worker import sse_data

THRESHOLD = 48  # tokens; the prompts below are far from it on either side
WORKERS = ("local-prefill-0", "local-decode-0")
PD_CONFIG = ENGINE_CONFIG.replace('type = "engine"\n', f"""type = "engine"
replicas = 2
prefill_replicas = 1
pd_threshold_tokens = {THRESHOLD}
max_num_batched_tokens = 64
enable_prefix_caching = true
""") + """
[server]
admin_key = "pd-admin"
health_check_interval = 0.2
eject_cooldown = 1.0
"""
SHORT = "The capital of France is"
LONG = "Here are some notes about the solar system. " + " ".join(
    f"Planet number {i} has {i + 2} moons and a day of {10 + i} hours." for i in range(12)) + " In summary,"


@pytest.fixture(scope="module")
def pd_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_gateway(PD_CONFIG, tmp_path_factory.mktemp("pd-gateway")) as url:
        yield url


@pytest.fixture(autouse=True)
def nothing_held_after_each_test(pd_gateway: str) -> Iterator[None]:
    yield
    wait_until(lambda: all_free(pd_gateway), "both workers idle with every block free and no handover file left")


def samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text
    return [(s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]


def by_worker(url: str, name: str) -> dict[str, float]:
    return {labels["backend"]: v for labels, v in samples(url, name) if labels.get("backend") in WORKERS}


def paths(url: str) -> dict[str, float]:
    return {labels["path"]: v for labels, v in samples(url, "llmgw_pd_requests_total")}


def all_free(url: str) -> bool:
    total, used = by_worker(url, "llmgw_engine_kv_blocks_total"), by_worker(url, "llmgw_engine_kv_blocks_used")
    running, waiting = by_worker(url, "llmgw_engine_running_seqs"), by_worker(url, "llmgw_engine_waiting_seqs")
    files = list(transfer_dir().glob(f"{PREFIX}*"))
    return (len(total) == 2 and all(total.values()) and set(used.values()) == {0.0}
            and set(running.values()) == {0.0} and set(waiting.values()) == {0.0} and not files)


def completions(url: str, prompt: str, n: int, stream: bool) -> str:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": n, "temperature": 0}
    if not stream:
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT).json()
        assert answer["usage"]["completion_tokens"] == n
        return answer["choices"][0]["text"]
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=CLIENT_TIMEOUT) as r:
        return "".join(c["choices"][0]["text"] for c in sse_data(r.iter_lines()) if c["choices"])


def tgi(url: str, prompt: str, n: int, stream: bool) -> str:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True}}
    if not stream:
        return httpx.post(f"{url}/generate", json=body, timeout=CLIENT_TIMEOUT).json()["generated_text"]
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=CLIENT_TIMEOUT) as r:
        events = list(sse_data(r.iter_lines()))
    assert events[-1]["details"]["generated_tokens"] == n
    return "".join(e["token"]["text"] for e in events if not e["token"]["special"])


@pytest.mark.parametrize("door", [completions, tgi], ids=["openai", "tgi"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_greedy_output_equals_colocated_below_and_above_the_threshold(pd_gateway, engine_fp32, door, stream):
    before = paths(pd_gateway)
    long = f"[{door.__name__}, {stream}] {LONG}"  # a prompt neither worker has seen
    for prompt, path in ((SHORT, "local"), (long, "remote"), (long, "local")):  # the last: cached on decode
        assert door(pd_gateway, prompt, 20, stream) == colocated(engine_fp32, prompt, 20)
        after = paths(pd_gateway)
        assert after.get(path, 0) == before.get(path, 0) + 1, (path, before, after)
        before = after


def test_chat_through_a_handover_equals_colocated(pd_gateway, engine_fp32):
    messages = [{"role": "system", "content": "Chat. " + LONG},
                {"role": "user", "content": "What is the capital of France?"}]
    rendered = engine_fp32.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = colocated(engine_fp32, engine_fp32.tokenizer.encode(rendered, add_special_tokens=False), 24)
    before = paths(pd_gateway).get("remote", 0)
    body = {"model": "smollm2", "messages": messages, "max_tokens": 24, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{pd_gateway}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT) as r:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_data(r.iter_lines())
                       if c["choices"])
    assert text == expected
    assert paths(pd_gateway)["remote"] == before + 1


def test_the_handover_is_measured_and_each_workers_role_is_shown(pd_gateway):
    completions(pd_gateway, "Measured. " + LONG, 4, stream=False)
    sizes = {labels.get("backend"): v for labels, v in samples(pd_gateway, "llmgw_pd_kv_transfer_bytes_sum")}
    counts = {labels.get("backend"): v for labels, v in samples(pd_gateway, "llmgw_pd_kv_transfer_bytes_count")}
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2 in fp32: layers x (K, V) x KV heads x head dim x 4 bytes
    assert sizes["local"] > 0 and sizes["local"] % per_token == 0  # whole tokens of KV, each handover
    assert samples(pd_gateway, "llmgw_pd_kv_transfer_seconds_count")[0][1] == counts["local"]
    admin = httpx.get(f"{pd_gateway}/admin/backends", headers={"authorization": "Bearer pd-admin"},
                      timeout=CLIENT_TIMEOUT).json()["backends"]["local"]
    assert "local-prefill-0 prefill" in admin and "local-decode-0 decode" in admin, admin


def test_a_client_leaving_mid_stream_and_a_refused_request_free_both_workers(pd_gateway):
    body = {"model": "smollm2", "prompt": "Leaving. " + LONG, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{pd_gateway}/v1/completions", json=body, timeout=CLIENT_TIMEOUT) as r:
        chunks = sse_data(r.iter_lines())
        next(chunks), next(chunks)  # the prefill worker's token and the decode worker's first: then hang up
    wait_until(lambda: all_free(pd_gateway), "both workers' blocks freed after the client left")
    # refused by the engine on the prefill leg (a grammar it cannot compile): the protocol's error, no fallback
    bad = {"inputs": LONG, "parameters": {"max_new_tokens": 8, "grammar": {"type": "regex", "value": "(unclosed"}}}
    refused = httpx.post(f"{pd_gateway}/generate", json=bad, timeout=CLIENT_TIMEOUT)
    assert refused.status_code in (400, 422) and "error" in refused.json()


def test_a_prefill_worker_killed_mid_transfer_is_replaced_by_a_local_prefill(pd_gateway, engine_fp32):
    """SIGKILL the prefill worker while it prefills a long prompt (64-token chunks: many steps): the request is
    prefilled by the decode worker instead and answers as colocated serving would; the worker comes back."""
    prompt = "Killed. " + LONG * 4  # ~850 tokens: 14 chunks
    expected = colocated(engine_fp32, prompt, 12)
    pid = int(by_worker(pd_gateway, "llmgw_engine_worker_pid")["local-prefill-0"])
    before = paths(pd_gateway).get("fallback", 0)
    result: dict[str, str] = {}

    def ask() -> None:
        result["text"] = completions(pd_gateway, prompt, 12, stream=False)

    thread = threading.Thread(target=ask)
    thread.start()
    wait_until(lambda: by_worker(pd_gateway, "llmgw_engine_running_seqs").get("local-prefill-0") == 1,
               "the prefill worker running the prompt", interval=0.01)
    os.kill(pid, signal.SIGKILL)
    thread.join(CLIENT_TIMEOUT)
    assert result["text"] == expected
    assert paths(pd_gateway)["fallback"] == before + 1
    wait_until(lambda: by_worker(pd_gateway, "llmgw_engine_worker_restarts_total").get("local-prefill-0") == 1
               and by_worker(pd_gateway, "llmgw_engine_worker_up").get("local-prefill-0") == 1,
               "the prefill worker restarted")
    wait_until(lambda: {labels["replica"]: v for labels, v in samples(pd_gateway, "llmgw_replica_healthy")}
               .get("local-prefill-0") == 1, "the pool taking the restarted worker back (health check, no ejection)")
    remote = paths(pd_gateway).get("remote", 0)
    again = "Again. " + LONG
    assert completions(pd_gateway, again, 8, stream=False) == colocated(engine_fp32, again, 8)
    assert paths(pd_gateway)["remote"] == remote + 1  # the restarted prefill worker takes handovers again


def test_the_kv_can_travel_in_the_workers_zeromq_messages(tmp_path: Path, engine_fp32):
    """kv_transport = "zmq" (workers that share no memory): the same text, and no handover file is written."""
    config = PD_CONFIG.replace("prefill_replicas = 1\n", 'prefill_replicas = 1\nkv_transport = "zmq"\n')
    with running_gateway(config, tmp_path) as url:
        prompt = "Inline. " + LONG
        assert completions(url, prompt, 16, stream=True) == colocated(engine_fp32, prompt, 16)
        assert paths(url) == {"remote": 1.0}
        sizes = [v for labels, v in samples(url, "llmgw_pd_kv_transfer_bytes_sum")]
        assert sizes and sizes[0] > 0
        wait_until(lambda: all_free(url), "both workers idle")


def test_check_config_names_the_roles(tmp_path: Path):
    import subprocess
    import sys

    config = tmp_path / "config.toml"
    config.write_text(PD_CONFIG)
    out = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(config)], capture_output=True,
                         text=True, timeout=CLIENT_TIMEOUT, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert out.returncode == 0, out.stderr
    assert "1 prefill" in out.stdout and "1 decode" in out.stdout and f"from {THRESHOLD} uncached" in out.stdout
