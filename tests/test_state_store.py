"""The SQLite state store through a real gateway: stored keys, usage rows and stored Responses survive
a restart; the key admin API refuses bad input and leaves the store as it was."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.recordings import openai_text_routes
from tests.server import CLIENT_TIMEOUT, ENGINE_CONFIG, running_gateway, wait_until
from tests.upstream import scripted_upstream

ADMIN = "admin-secret-0123456789"
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}


def state_config(tmp: Path, backends: str = ENGINE_CONFIG) -> str:
    return f'{backends}\n[server]\nadmin_key = "{ADMIN}"\n[state]\ndatabase = "sqlite:///{tmp}/state.db"\n' \
           f"key_refresh_interval = 0.5\nusage_flush_interval = 0.2\n"


def admin(method: str, url: str, path: str, **kwargs: Any) -> httpx.Response:
    kwargs.setdefault("headers", ADMIN_HEADERS)
    return httpx.request(method, f"{url}{path}", timeout=CLIENT_TIMEOUT, **kwargs)


def usage_rows(url: str, **params: str) -> list[dict[str, Any]]:
    r = admin("GET", url, "/admin/usage", params=params)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_stored_key_usage_and_previous_response_id_survive_a_restart(tmp_path: Path) -> None:
    config = state_config(tmp_path)
    with running_gateway(config, tmp_path) as url:
        created = admin("POST", url, "/admin/keys", json={"name": "team-a", "models": ["smollm2"],
                                                          "metadata": {"team": "a", "owner": "ada"}})
        assert created.status_code == 201, created.text
        secret, key_id = created.json()["key"], created.json()["id"]
        assert created.json()["metadata"] == {"team": "a", "owner": "ada"}
        listed = admin("GET", url, "/admin/keys").json()["data"]
        assert [k["name"] for k in listed] == ["team-a"] and listed[0]["key"] is None  # the secret shown once
        assert secret not in admin("GET", url, "/admin/keys").text

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=secret, timeout=CLIENT_TIMEOUT, max_retries=0)
        chat = client.chat.completions.create(model="smollm2", max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": "Say hello."}])
        assert chat.usage is not None and chat.usage.completion_tokens > 0
        claude = anthropic.Anthropic(base_url=url, api_key=secret, timeout=CLIENT_TIMEOUT, max_retries=0)
        message = claude.messages.create(model="smollm2", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
        assert message.usage.output_tokens > 0
        first = client.responses.create(model="smollm2", input="My name is Ada. Remember it.", max_output_tokens=8,
                                        temperature=0, store=True)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key=secret + "x", max_retries=0,
                          timeout=CLIENT_TIMEOUT).models.list()

    with running_gateway(config, tmp_path) as url:  # a new process on the same state.db
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=secret, timeout=CLIENT_TIMEOUT, max_retries=0)
        by_door = {row["door"]: row for row in usage_rows(url, group_by="key,door")}
        assert set(by_door) == {"openai", "anthropic", "responses"}
        assert all(row["key"] == "team-a" and row["requests"] == 1 and row["errors"] == 0 for row in by_door.values())
        assert by_door["openai"]["prompt_tokens"] == chat.usage.prompt_tokens
        assert by_door["openai"]["completion_tokens"] == chat.usage.completion_tokens
        assert by_door["anthropic"]["completion_tokens"] == message.usage.output_tokens

        assert client.responses.retrieve(first.id).id == first.id
        follow = client.responses.create(model="smollm2", previous_response_id=first.id, input="What is my name?",
                                         max_output_tokens=8, temperature=0)
        assert follow.status in ("completed", "incomplete")
        assert first.usage is not None and follow.usage is not None
        # the follow-up's prompt carries the first turn (its input and its answer) before its own words
        assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

        revoked = admin("DELETE", url, f"/admin/keys/{key_id}")
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        wait_until(lambda: sum(r["requests"] for r in usage_rows(url)) == 4, "the follow-up's usage row written")
        report = admin("GET", url, "/admin/usage", params={"format": "csv", "group_by": "key,model,backend,day"})
        rows = list(csv.DictReader(io.StringIO(report.text)))
        assert report.headers["content-type"].startswith("text/csv")
        assert [(r["key"], r["model"], r["backend"], r["requests"]) for r in rows] == [("team-a", "smollm2", "local",
                                                                                        "4")]


@pytest.fixture(scope="module")
def light_gateway(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A gateway with a SQLite store in front of a scripted OpenAI upstream (no model to load)."""
    tmp = tmp_path_factory.mktemp("state-light")
    with scripted_upstream(openai_text_routes("Hello world!")) as upstream:
        backends = f'[backends.up]\ntype = "openai"\nbase_url = "{upstream.url}"\nmodel = "m"\n' \
                   f'[models.m]\nbackend = "up"\n'
        with running_gateway(state_config(tmp, backends), tmp) as url:
            yield url


BAD_BODIES = [
    (b'{"name": "x",', "not valid JSON"),
    (b'{"name": "team-b", "rpm": -5}', "rpm"),
    (b'{"name": "team-b", "max_tokens_per_day": 0}', "max_tokens_per_day"),
    (b'{"name": ""}', "name"),
    (b'{"name": "has spaces"}', "name"),
    (b'{"name": "team-b", "models": ["no-such-model"]}', "no-such-model"),
    (b'{"name": "team-b", "colour": "red"}', "colour"),
    (b'{"name": "team-b", "expires_at": "tomorrow"}', "expires_at"),
    (b'[1, 2]', "invalid body"),
]


def test_bad_key_bodies_get_a_clear_4xx_and_change_nothing(light_gateway: str) -> None:
    url = light_gateway
    existing = admin("POST", url, "/admin/keys", json={"name": "existing", "rpm": 10})
    assert existing.status_code == 201
    before = admin("GET", url, "/admin/keys", params={"include_revoked": "true"}).json()
    for body, named in BAD_BODIES:
        r = admin("POST", url, "/admin/keys", content=body, headers={**ADMIN_HEADERS,
                                                                     "content-type": "application/json"})
        assert r.status_code == 400, (body, r.text)
        assert named in r.json()["error"], (body, r.json())
    assert admin("POST", url, "/admin/keys", json={"name": "existing"}).status_code == 409  # a live key's name
    key_id = existing.json()["id"]
    assert admin("PATCH", url, f"/admin/keys/{key_id}", json={"tpm": -1}).status_code == 400
    unknown = "key_" + "0" * 24
    assert admin("PATCH", url, f"/admin/keys/{unknown}", json={"tpm": 5}).status_code == 404
    assert admin("DELETE", url, f"/admin/keys/{unknown}").status_code == 404
    assert admin("POST", url, f"/admin/keys/{unknown}/rotate").status_code == 404
    assert admin("GET", url, "/admin/keys/not-a-key-id").status_code == 422  # not an id at all
    for headers in ({"authorization": "Bearer wrong-admin-key"}, {}):
        r = admin("POST", url, "/admin/keys", json={"name": "sneaky"}, headers=headers)
        assert r.status_code == 401
        assert admin("GET", url, "/admin/keys", headers=headers).status_code == 401
        assert admin("GET", url, "/admin/usage", headers=headers).status_code == 401
    r = admin("GET", url, "/admin/usage", params={"group_by": "colour"})
    assert r.status_code == 400 and "colour" in r.json()["error"]
    assert admin("GET", url, "/admin/usage", params={"start": "last tuesday"}).status_code == 400
    assert admin("GET", url, "/admin/keys", params={"include_revoked": "true"}).json() == before


def test_a_patched_limit_and_a_rotated_secret_apply_at_once(light_gateway: str) -> None:
    url = light_gateway
    created = admin("POST", url, "/admin/keys", json={"name": "rotating"}).json()
    old = created["key"]

    def chat(secret: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", headers={"authorization": f"Bearer {secret}"},
                          json={"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5},
                          timeout=CLIENT_TIMEOUT)

    assert chat(old).status_code == 200
    patched = admin("PATCH", url, f"/admin/keys/{created['id']}", json={"rpm": 1, "metadata": {"team": "r"}})
    assert patched.status_code == 200 and patched.json()["rpm"] == 1 and patched.json()["metadata"] == {"team": "r"}
    assert [chat(old).status_code for _ in range(2)] == [200, 429]  # one request a minute, from now
    cleared = admin("PATCH", url, f"/admin/keys/{created['id']}", json={"rpm": None})
    assert cleared.json()["rpm"] is None and chat(old).status_code == 200
    rotated = admin("POST", url, f"/admin/keys/{created['id']}/rotate", json={"grace_seconds": 3600})
    new = rotated.json()["key"]
    assert rotated.status_code == 200 and new != old and rotated.json()["previous_secret_expires_at"]
    assert chat(new).status_code == 200 and chat(old).status_code == 200  # the old one in its grace period
    admin("POST", url, f"/admin/keys/{created['id']}/rotate", json={"grace_seconds": 0})
    assert chat(old).status_code == 401 and chat(new).status_code == 401  # both replaced, no grace


def test_an_expired_key_is_refused_and_the_cli_manages_keys(light_gateway: str) -> None:
    url = light_gateway
    expired = admin("POST", url, "/admin/keys", json={"name": "last-year", "expires_at": "2025-01-01T00:00:00Z"})
    assert expired.status_code == 201 and expired.json()["expires_at"] == "2025-01-01T00:00:00Z"
    r = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {expired.json()['key']}"},
                  timeout=CLIENT_TIMEOUT)
    assert r.status_code == 401 and r.json()["error"]["code"] == "expired_api_key"

    def llmgw(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gateway", "keys", *args, "--url", url], capture_output=True,
                              text=True, timeout=CLIENT_TIMEOUT, env={**os.environ, "LLMGW_ADMIN_KEY": ADMIN})

    made = llmgw("create", "--name", "from-the-cli", "--rpm", "60", "--meta", "team=ops")
    assert made.returncode == 0, made.stderr
    key = json.loads(made.stdout)
    assert key["rpm"] == 60 and key["metadata"] == {"team": "ops"} and "shown only once" in made.stderr
    assert httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {key['key']}"},
                     timeout=CLIENT_TIMEOUT).status_code == 200
    listed = llmgw("list")
    assert listed.returncode == 0 and "from-the-cli" in listed.stdout and key["key"] not in listed.stdout
    assert llmgw("revoke", "--id", key["id"]).returncode == 0
    assert httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {key['key']}"},
                     timeout=CLIENT_TIMEOUT).status_code == 401
    refused = llmgw("create", "--name", "bad", "--rpm", "-1")
    assert refused.returncode == 1 and "400" in refused.stderr
