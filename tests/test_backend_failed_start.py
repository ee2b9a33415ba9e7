"""A backend that fails to start says so, and why, everywhere a user looks: /health's 503 body, /admin/backends,
the metrics and the answer to a request for its model; a reload that replaces it with a working one clears it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server import CLIENT_TIMEOUT, START_TIMEOUT, running_gateway, wait_until

ADMIN = {"authorization": "Bearer failed-start-admin"}
CHAT = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}

CONFIG = """
default_model = "{default}"

[server]
admin_key = "failed-start-admin"

[backends.local]
type = "engine"
model = "{local}"
dtype = "float32"
kv_cache_mb = 64
"""

MORE = """
[backends.gone]
type = "engine"
model = "{gone}"

[backends.good]
type = "engine"
model = "embedded"
dtype = "float32"
kv_cache_mb = 64

[models.broken]
backend = "local"

[models.missing]
backend = "gone"

[models.rescued]
backend = "local"
fallback = ["good"]
"""


@pytest.fixture
def gpt2_dir(tmp_path: Path) -> Path:
    """A model directory the engine refuses at once: its config.json names an architecture it lacks."""
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    return model


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT)


def states(url: str) -> dict[str, str]:
    body = health(url)
    return body.json()["backends"] if body.status_code == 503 else {}


def metric(url: str, name: str, backend: str) -> str | None:
    """The sample's value as the exposition writes it ("1.0"), or None when there is none."""
    text = httpx.get(f"{url}/metrics", timeout=CLIENT_TIMEOUT).text
    prefix = f'{name}{{backend="{backend}"}} '
    return next((line.removeprefix(prefix) for line in text.splitlines() if line.startswith(prefix)), None)


def chat(url: str, model: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": model, **CHAT, **extra}, timeout=CLIENT_TIMEOUT)


def test_failed_start_shows_its_reason_and_its_model_answers_503(tmp_path: Path, gpt2_dir: Path) -> None:
    gone = tmp_path / "no-such-model"
    config = CONFIG.format(default="broken", local=gpt2_dir) + MORE.format(gone=gone)
    with running_gateway(config, tmp_path, wait_healthy=False) as url:
        def settled() -> dict[str, str] | None:
            now = states(url)
            failed = all(now.get(n, "").startswith("failed: ") for n in ("local", "gone"))
            return now if failed and now.get("good") == "healthy" else None

        said = wait_until(settled, "both broken backends failed, the good one serves", timeout=START_TIMEOUT,
                          interval=0.2)
        # still 503: `broken` and `missing` have no backend that serves (`rescued` has its fallback)
        assert health(url).status_code == 503
        assert said["local"].startswith("failed: ")
        assert f"{gpt2_dir}/config.json" in said["local"] and "GPT2LMHeadModel" in said["local"]
        assert said["gone"].startswith("failed: ")
        assert str(gone) in said["gone"] and "no such directory" in said["gone"]

        admin = httpx.get(f"{url}/admin/backends", headers=ADMIN, timeout=CLIENT_TIMEOUT).json()
        assert admin["backends"] == said
        migrations = httpx.get(f"{url}/admin/migrations", headers=ADMIN, timeout=CLIENT_TIMEOUT).json()
        assert migrations["backends"] == said

        for name, failed in (("local", "1.0"), ("gone", "1.0"), ("good", "0.0")):
            assert metric(url, "llmgw_backend_failed", name) == failed, name
        assert metric(url, "llmgw_backend_healthy", "local") == "0.0"

        # the protocol's own 503, naming the backend and why; the same for a stream (refused before it begins)
        for stream in (False, True):
            refused = chat(url, "broken", stream=stream)
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert (error["type"], error["code"]) == ("service_unavailable_error", "backend_failed")
            assert "backend `local` failed to start" in error["message"] and "GPT2LMHeadModel" in error["message"]
        missing = chat(url, "missing").json()["error"]
        assert "backend `gone` failed to start" in missing["message"] and str(gone) in missing["message"]
        tgi = httpx.post(f"{url}/generate", json={"inputs": "hi"}, timeout=CLIENT_TIMEOUT)
        assert tgi.status_code == 503 and tgi.json()["error_type"] == "unavailable"
        assert "backend `local` failed to start" in tgi.json()["error"]

        rescued = chat(url, "rescued")  # its failed backend is skipped: the fallback serves at once
        assert rescued.status_code == 200, rescued.text
        assert rescued.headers["x-backend"] == "good"


def test_a_reload_that_replaces_the_failed_backend_clears_it(tmp_path: Path, gpt2_dir: Path) -> None:
    config = CONFIG + "\n[models.m]\nbackend = \"local\"\n"
    with running_gateway(config.format(default="m", local=gpt2_dir), tmp_path, wait_healthy=False) as url:
        wait_until(lambda: states(url).get("local", "").startswith("failed: "), "the start failed",
                   timeout=START_TIMEOUT, interval=0.2)

        # a replacement that fails too is refused, with its reason; the failed one stays as it was
        (tmp_path / "config.toml").write_text(config.format(default="m", local=tmp_path / "nowhere"))
        refused = httpx.post(f"{url}/admin/reload", headers=ADMIN, timeout=START_TIMEOUT)
        assert refused.status_code == 400
        assert "backends.local: failed to start" in refused.text and "nowhere" in refused.text
        assert "GPT2LMHeadModel" in states(url)["local"]

        (tmp_path / "config.toml").write_text(config.format(default="m", local="embedded"))
        reloaded = httpx.post(f"{url}/admin/reload", headers=ADMIN, timeout=START_TIMEOUT)  # waits for the start
        assert reloaded.status_code == 200, reloaded.text
        assert health(url).status_code == 200
        assert httpx.get(f"{url}/admin/backends", headers=ADMIN, timeout=CLIENT_TIMEOUT).json()["backends"] == {
            "local": "healthy"}
        assert metric(url, "llmgw_backend_failed", "local") == "0.0"
        assert metric(url, "llmgw_backend_healthy", "local") == "1.0"
        served = chat(url, "m")
        assert served.status_code == 200, served.text
