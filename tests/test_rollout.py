"""Staged rollouts through a real gateway (gateway/rollout/): the in-process engine is each model's backend,
and candidates are scripted upstreams that are slow, answer differently or break tool calls (each rolls
back, naming its gate), or a second engine with the same weights (promoted to 100%, written into the
config file). The rollout's step and windows survive a restart; bad requests change nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.recordings import openai_text_routes
from tests.server import CLIENT_TIMEOUT, running_gateway, wait_until
from tests.upstream import Reply, ScriptedUpstream, by_stream, scripted_upstream, sse

ADMIN = {"authorization": "Bearer ro-admin"}
MODELS = ("m-slow", "m-diverge", "m-tools", "m-twin", "m-restart")
ENGINE = """[backends.{name}]
type = "engine"
model = "embedded"
dtype = "float32"
kv_cache_mb = 128
max_num_seqs = 8

"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PROMPTS = [f"Question {i}: name a colour that starts with the letter {c}." for i, c in enumerate("BGRYPOW")]


def quick(**gates: float | None) -> dict[str, Any]:
    """A rollout spec fit for a test: one live step at 50%, then 100%; only the gates named are on."""
    off = {name: None for name in ("ttft_p95_ratio", "tpot_p50_ratio", "error_rate_increase", "min_agreement",
                                   "min_topk_containment", "tool_call_validity_drop", "structured_validity_drop",
                                   "prompt_token_mismatch")}
    return {"steps": [50, 100], "step_min_seconds": 0, "step_min_requests": 12, "step_max_seconds": 600,
            "analysis_interval": 0.2, "min_samples": 5, "mirror_sample": 1.0, "gates": {**off, **gates}}


def tool_routes() -> dict:
    """An OpenAI server whose tool calls break their schema (`city` a number)."""
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": 5}'}}
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]}
    usage = {"prompt_tokens": 40, "completion_tokens": 9, "total_tokens": 49}
    whole = {"id": "x", "object": "chat.completion", "created": 1, "model": "m", "usage": usage, "choices": [
        {"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None,
                                                                 "tool_calls": [call]}}]}
    done = sse({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                "usage": usage}, b"[DONE]")
    return {("GET", "/v1/models"): Reply([b'{"data":[]}'], 200, "application/json"),
            ("POST", "/v1/chat/completions"): by_stream(Reply([sse(chunk), done]),
                                                        Reply([json.dumps(whole).encode()], 200, "application/json"))}


def config(upstreams: dict[str, ScriptedUpstream]) -> str:
    text = 'default_model = "m-twin"\n\n' + ENGINE.format(name="local") + ENGINE.format(name="twin")
    for name, upstream in upstreams.items():
        text += (f'[backends.{name}]\ntype = "openai"\nbase_url = "http://127.0.0.1:{upstream.port}"\n'
                 f'model = "m"\nfirst_token_timeout = 60\n\n')
    for model in MODELS:
        text += f'[models.{model}]\nbackend = "local"\nmax_total_tokens = 2048\n\n'
    return text + '[server]\nadmin_key = "ro-admin"\n'


@pytest.fixture(scope="module")
def upstreams() -> Iterator[dict[str, ScriptedUpstream]]:
    with scripted_upstream(openai_text_routes("Blue is a colour", first_delay=5.0)) as slow, \
            scripted_upstream(openai_text_routes("Something else entirely")) as diverge, \
            scripted_upstream(tool_routes()) as tools:
        yield {"slow": slow, "diverge": diverge, "tools": tools}


@pytest.fixture(scope="module")
def gateway_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rollout")


@pytest.fixture(scope="module")
def gateway(upstreams: dict[str, ScriptedUpstream], gateway_dir: Path) -> Iterator[str]:
    with running_gateway(config(upstreams), gateway_dir, env={"LLMGW_STATE_DIR": str(gateway_dir / "state")}) as url:
        yield url


def start(url: str, model: str, candidate: str, spec: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/admin/rollouts", json={"model": model, "candidate": candidate, **spec}, headers=ADMIN,
                      timeout=CLIENT_TIMEOUT)


def rollout(url: str, model: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/admin/rollouts/{model}", headers=ADMIN, timeout=CLIENT_TIMEOUT)
    assert answer.status_code == 200, answer.text
    return answer.json()


def ask(url: str, model: str, i: int, tools: bool = False) -> str:
    """One greedy request; the backend that served it (x-backend)."""
    if tools:
        body = {"model": model, "messages": [{"role": "user", "content": f"Weather in city number {i}?"}],
                "tools": [WEATHER], "tool_choice": "required", "max_tokens": 120, "temperature": 0}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT)
    else:
        body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 6, "temperature": 0}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT)
    assert answer.status_code == 200, answer.text
    return answer.headers["x-backend"]


def drive(url: str, model: str, until: set[str], tools: bool = False, limit: int = 600) -> dict[str, Any]:
    """Send requests, four at a time, until the rollout reaches one of the `until` states."""
    stop = threading.Event()
    count = [0]

    def worker(k: int) -> None:
        while not stop.is_set() and count[0] < limit:
            count[0] += 1
            ask(url, model, count[0] + k, tools)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(worker, k) for k in range(4)]
        try:
            wait_until(lambda: rollout(url, model)["state"] in until or count[0] >= limit,
                       f"the rollout of {model} reaching {until}", timeout=600, interval=0.2)
        finally:
            stop.set()
            for f in futures:
                f.result()
    return rollout(url, model)


def last_decision(state: dict[str, Any]) -> dict[str, Any]:
    return state["decisions"][-1]


def test_a_candidate_three_times_slower_to_first_token_rolls_back_at_the_first_step_on_the_ttft_gate(gateway):
    assert start(gateway, "m-slow", "slow", quick(ttft_p95_ratio=1.5)).status_code == 201
    state = drive(gateway, "m-slow", {"rolled_back", "promoted", "paused"})
    assert state["state"] == "rolled_back" and state["step"] == 0 and state["weight"] == 0
    decision = last_decision(state)
    assert decision["action"] == "rollback" and decision["reason"].startswith("ttft_p95_ratio")
    gate = next(g for g in decision["gates"] if g["name"] == "ttft_p95_ratio")
    assert gate["status"] == "fail" and gate["value"] > 1.5
    assert {ask(gateway, "m-slow", i) for i in range(6)} == {"local"}  # back at 0% at once
    # what Argo Rollouts' web provider ($.results.ok) and Flagger's webhooks (the status) gate on
    analysis = httpx.get(f"{gateway}/admin/rollouts/m-slow/analysis", headers=ADMIN, timeout=CLIENT_TIMEOUT).json()
    assert analysis["results"]["ok"] == 0 and analysis["results"]["failed"] == 1
    assert analysis["results"]["failed_gates"] == ["ttft_p95_ratio"]
    assert httpx.post(f"{gateway}/admin/rollouts/m-slow/analysis", headers=ADMIN,
                      timeout=CLIENT_TIMEOUT).status_code == 412


def test_a_candidate_whose_greedy_answers_differ_rolls_back_on_agreement(gateway):
    assert start(gateway, "m-diverge", "diverge", quick(min_agreement=0.8)).status_code == 201
    state = drive(gateway, "m-diverge", {"rolled_back", "promoted", "paused"})
    assert state["state"] == "rolled_back"
    decision = last_decision(state)
    assert decision["reason"].startswith("agreement")
    assert state["window"]["pairs"]["greedy"] >= 5 and state["window"]["pairs"]["exact"] == 0
    assert state["window"]["pairs"]["examples"][0]["candidate"] == "Something else entirely"


def test_a_candidate_that_breaks_tool_calls_rolls_back_on_validity(gateway):
    assert start(gateway, "m-tools", "tools", quick(tool_call_validity_drop=0.1)).status_code == 201
    state = drive(gateway, "m-tools", {"rolled_back", "promoted", "paused"}, tools=True)
    assert state["state"] == "rolled_back"
    assert last_decision(state)["reason"].startswith("tool_call_validity")
    window = state["window"]
    assert window["baseline"]["tool_valid"] == window["baseline"]["tool_answers"] > 0
    assert window["candidate"]["tool_answers"] > 0 and window["candidate"]["tool_valid"] == 0


def test_an_identical_candidate_is_promoted_to_100_percent_and_the_config_names_it(gateway, gateway_dir):
    # latency gates are left to the slow candidate's test: two engines sharing two busy cores differ by chance
    spec = quick(error_rate_increase=0.25, min_agreement=0.8, prompt_token_mismatch=0.0)
    assert start(gateway, "m-twin", "twin", spec).status_code == 201
    state = drive(gateway, "m-twin", {"rolled_back", "promoted", "paused"})
    assert state["state"] == "promoted", state["decisions"]
    actions = [d["action"] for d in state["decisions"]]
    assert actions == ["start", "promote"]
    assert {g["name"]: g["status"] for g in last_decision(state)["gates"]} == {
        "error_rate": "pass", "agreement": "pass", "prompt_token_parity": "pass"}
    wait_until(lambda: tomllib.loads((gateway_dir / "config.toml").read_text())["models"]["m-twin"]["backend"]
               == "twin", "the config file naming the candidate")
    wait_until(lambda: {ask(gateway, "m-twin", i) for i in range(4)} == {"twin"}, "all traffic on the candidate")
    webhook = httpx.post(f"{gateway}/admin/rollouts/m-twin/analysis", headers=ADMIN, timeout=CLIENT_TIMEOUT)
    assert webhook.status_code == 200 and webhook.json()["results"] == {
        "ok": 1.0, "failed": 0.0, "failed_gates": [], "inconclusive_gates": []}


def test_bad_rollout_requests_get_a_clear_4xx_and_change_nothing(gateway):
    before = httpx.get(f"{gateway}/admin/rollouts", headers=ADMIN, timeout=CLIENT_TIMEOUT).json()
    cases = [
        ({"model": "no-such-model", "candidate": "twin"}, 404, "unknown model"),
        ({"model": "m-restart", "candidate": "local"}, 400, "already serves"),
        ({"model": "m-restart", "candidate": "nope"}, 400, "no backend"),
        ({"model": "m-restart", "candidate": "twin", "steps": [50, 25, 100]}, 400, "rise"),
        ({"model": "m-restart", "candidate": "twin", "steps": [10, 50]}, 400, "last step must be 100"),
        ({"model": "m-restart", "candidate": "twin", "alpha": 2}, 400, "alpha"),
        ({"model": "m-restart", "candidate": "twin", "gates": {"ttft": 1}}, 400, "ttft"),
        ({"model": "m-restart"}, 400, "candidate"),
    ]
    for body, status, words in cases:
        answer = httpx.post(f"{gateway}/admin/rollouts", json=body, headers=ADMIN, timeout=CLIENT_TIMEOUT)
        assert answer.status_code == status and words in answer.text, (body, answer.status_code, answer.text)
    assert httpx.post(f"{gateway}/admin/rollouts", content=b"{", headers=ADMIN,
                      timeout=CLIENT_TIMEOUT).status_code == 400
    assert httpx.post(f"{gateway}/admin/rollouts", json={"model": "m-restart", "candidate": "twin"},
                      timeout=CLIENT_TIMEOUT).status_code == 401
    assert httpx.post(f"{gateway}/admin/rollouts/m-restart/pause", headers=ADMIN,
                      timeout=CLIENT_TIMEOUT).status_code == 404
    assert httpx.get(f"{gateway}/admin/rollouts", headers=ADMIN, timeout=CLIENT_TIMEOUT).json() == before
    # a second rollout of a model already rolling: 409, the first one untouched
    assert start(gateway, "m-restart", "twin", {**quick(), "step_min_requests": 10_000}).status_code == 201
    second = start(gateway, "m-restart", "slow", quick())
    assert second.status_code == 409 and "already rolling out" in second.text
    assert rollout(gateway, "m-restart")["candidate"] == "twin"
    assert httpx.post(f"{gateway}/admin/rollouts/m-restart/resume", headers=ADMIN,
                      timeout=CLIENT_TIMEOUT).status_code == 409  # not paused
    jump = httpx.post(f"{gateway}/admin/rollouts/m-restart/jump", headers=ADMIN, timeout=CLIENT_TIMEOUT)
    assert jump.status_code == 422 and "pause|resume|promote|abort|step-back" in jump.text


def scripted_config(upstreams: dict[str, ScriptedUpstream], baseline: str) -> str:
    text = 'default_model = "m"\n\n'
    for name, upstream in upstreams.items():
        text += (f'[backends.{name}]\ntype = "openai"\nbase_url = "http://127.0.0.1:{upstream.port}"\n'
                 f'model = "m"\nfirst_token_timeout = 60\n\n')
    return text + f'[models.m]\nbackend = "{baseline}"\n\n[server]\nadmin_key = "ro-admin"\n'


def held(**gates: float | None) -> dict[str, Any]:
    """A rollout that stays at its first step (30%) until told otherwise."""
    return {**quick(**gates), "steps": [30, 100], "step_min_requests": 100_000}


def served_by(url: str, n: int, model: str = "m") -> list[str]:
    with ThreadPoolExecutor(5) as pool:
        return list(pool.map(lambda i: ask(url, model, i), range(n)))


def test_a_gateway_restarted_mid_rollout_resumes_at_the_same_step_with_its_windows(tmp_path: Path):
    with scripted_upstream(openai_text_routes("Blue")) as a, scripted_upstream(openai_text_routes("Blue")) as b:
        text, env = scripted_config({"a": a, "b": b}, "a"), {"LLMGW_STATE_DIR": str(tmp_path / "state")}
        with running_gateway(text, tmp_path, env=env) as url:
            assert start(url, "m", "b", held(error_rate_increase=0.5)).status_code == 201
            # the split is random and a look comes as the samples grow by half: serve until a look has counted
            # 5 candidate requests, not a fixed number (40 left one CI run short of such a look)
            before = wait_until(lambda: served_by(url, 10) and (r := rollout(url, "m"))["window"]
                                .get("candidate", {}).get("requests", 0) >= 5 and r, "a look at the first step")
        with running_gateway(text, tmp_path, env=env) as url:
            after = rollout(url, "m")
            assert (after["state"], after["step"], after["weight"]) == ("running", 0, 30)
            assert after["epoch"] == before["epoch"] and after["decisions"] == before["decisions"]
            assert after["window"]["candidate"]["requests"] >= before["window"]["candidate"]["requests"]
            # still split; the window shown is the leader's last look, which comes as the samples grow by half:
            # keep serving until a look since the restart counts more requests than this run alone has served
            served: list[str] = []

            def both_runs_counted() -> bool:
                served.extend(served_by(url, 10))
                return total(rollout(url, "m")["window"]) > max(len(served), total(after["window"]))

            wait_until(both_runs_counted, "the windows of both runs counted together")
            assert set(served) == {"a", "b"}


def total(window: dict[str, Any]) -> int:
    return window["candidate"]["requests"] + window["baseline"]["requests"]


def test_two_gateways_follow_one_leader_and_split_traffic_by_the_step_weight(tmp_path: Path):
    with scripted_upstream(openai_text_routes("Blue")) as a, scripted_upstream(openai_text_routes("Blue")) as b:
        text, env = scripted_config({"a": a, "b": b}, "a"), {"LLMGW_STATE_DIR": str(tmp_path / "state")}
        (tmp_path / "one").mkdir()
        (tmp_path / "two").mkdir()
        with running_gateway(text, tmp_path / "one", env=env) as one, \
                running_gateway(text, tmp_path / "two", env=env) as two:
            assert start(one, "m", "b", held(error_rate_increase=0.5)).status_code == 201
            wait_until(lambda: httpx.get(f"{two}/admin/rollouts/m", headers=ADMIN, timeout=CLIENT_TIMEOUT)
                       .json().get("weight") == 30, "the second gateway following the stored step")
            wait_until(lambda: sorted(leader_metric(u) for u in (one, two)) == [0.0, 1.0], "exactly one leader")
            with ThreadPoolExecutor(5) as pool:
                backends = list(pool.map(lambda i: ask((one, two)[i % 2], "m", i), range(200)))
            share = backends.count("b") / len(backends)
            sigma = (0.3 * 0.7 / len(backends)) ** 0.5
            assert abs(share - 0.3) <= max(0.10, 3 * sigma), share  # Gateway API Inference Extension's bound
            paused = cli("pause", two)  # any replica takes an operator's action
            assert paused.returncode == 0 and "paused, candidate at 30%" in paused.stdout, paused.stderr
            wait_until(lambda: rollout(one, "m")["state"] == "paused", "the pause seen by the other gateway")
            status = cli("status", one)
            assert "m: a -> b  paused" in status.stdout and "last decision: pause" in status.stdout


def cli(action: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", "rollout", action, "--url", url, "--model", "m",
                           "--admin-key", "ro-admin"], capture_output=True, text=True, timeout=CLIENT_TIMEOUT)


def shadow_dropped(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("llmgw_shadow_comparisons_total{") and 'outcome="dropped"' in line)


def leader_metric(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("llmgw_rollout_leader "))


def test_a_shadow_phase_mirrors_every_request_before_the_first_live_step(tmp_path: Path):
    with scripted_upstream(openai_text_routes("Blue")) as a, scripted_upstream(openai_text_routes("Blue")) as b:
        with running_gateway(scripted_config({"a": a, "b": b}, "a"), tmp_path) as url:
            spec = {**held(min_agreement=0.8), "shadow_seconds": 0.5, "shadow_min_requests": 20}
            assert start(url, "m", "b", spec).json()["state"] == "shadow"
            assert {ask(url, "m", i) for i in range(10)} == {"a"}  # no live traffic while shadowing...
            # ...and each request mirrored to the candidate, or counted as dropped: mirrors never queue behind a
            # candidate that already has its limit (4) in flight, which one at a time it seldom has
            wait_until(lambda: len(b.sent("/v1/completions")) + shadow_dropped(url) >= 10,
                       "every request mirrored to the candidate (or counted as dropped)")
            assert len(b.sent("/v1/completions")) >= 1
            served_by(url, 60)
            state = wait_until(lambda: (r := rollout(url, "m"))["state"] == "running" and r, "the first live step")
            advance = last_decision(state)
            assert advance["action"] == "advance" and "the shadow phase" in advance["reason"]
            assert {g["name"]: g["status"] for g in advance["gates"]} == {"agreement": "pass"}
            assert state["weight"] == 30 and set(served_by(url, 40)) == {"a", "b"}  # ...then the step's split


def test_a_step_still_inconclusive_at_its_deadline_pauses_and_resumes_on_request(tmp_path: Path):
    with scripted_upstream(openai_text_routes("Blue")) as a, scripted_upstream(openai_text_routes("Blue")) as b:
        with running_gateway(scripted_config({"a": a, "b": b}, "a"), tmp_path) as url:
            # a p95 needs far more samples than a few requests give: the gate stays inconclusive. A bound no
            # timing noise can cross (1.2 let a busy CI machine's slow candidate fail it: a rollback, no pause)
            spec = {**held(ttft_p95_ratio=1000.0), "step_min_requests": 5, "step_max_seconds": 2.0}
            assert start(url, "m", "b", spec).status_code == 201
            served_by(url, 30)
            state = wait_until(lambda: (r := rollout(url, "m"))["state"] != "running" and r, "the step's end")
            assert state["state"] == "paused", last_decision(state)
            decision = last_decision(state)
            assert decision["action"] == "inconclusive" and "ttft_p95_ratio" in decision["reason"]
            assert state["weight"] == 30  # a pause holds the step's weights
            resumed = httpx.post(f"{url}/admin/rollouts/m/resume", headers=ADMIN, timeout=CLIENT_TIMEOUT).json()
            assert resumed["state"] == "running" and last_decision(resumed)["action"] == "resume"
            back = httpx.post(f"{url}/admin/rollouts/m/abort", headers=ADMIN, timeout=CLIENT_TIMEOUT).json()
            assert back["state"] == "aborted" and back["weight"] == 0
            assert set(served_by(url, 10)) == {"a"}


def test_a_candidate_that_answers_5xx_rolls_back_on_the_error_gates_by_class(tmp_path: Path):
    with scripted_upstream(openai_text_routes("Blue")) as a, \
            scripted_upstream(openai_text_routes("Blue", status=500)) as b:
        text = scripted_config({"a": a, "b": b}, "a").replace(  # passive ejection would hide the failing candidate
            'admin_key = "ro-admin"\n', 'admin_key = "ro-admin"\neject_after_failures = 1000\n')
        with running_gateway(text, tmp_path) as url:
            assert start(url, "m", "b", {**quick(error_rate_increase=0.05), "steps": [50, 100]}).status_code == 201
            body = {"model": "m", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
            statuses: set[int] = set()
            for _ in range(200):
                statuses.add(httpx.post(f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT).status_code)
                if rollout(url, "m")["state"] != "running":
                    break
            state = rollout(url, "m")
            assert state["state"] == "rolled_back" and statuses >= {200, 502}
            failed = {g["name"] for g in last_decision(state)["gates"] if g["status"] == "fail"}
            assert failed == {"error_rate", "error_rate_5xx"}
            assert state["window"]["candidate"]["errors"]["5xx"] >= 5
