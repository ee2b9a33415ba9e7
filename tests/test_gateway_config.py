"""config.toml handling, the CLI, and backends plugged in through the entry point group."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.config import ConfigError, parse_config
from tests.server import CLIENT_TIMEOUT, ROOT, WAIT, running_gateway, wait_until

BACKEND = '[backends.local]\ntype = "engine"\n'
MODEL = '[models.m]\nbackend = "local"\n'


@pytest.mark.parametrize(("text", "message"), [
    ("colour = 1\n" + BACKEND + MODEL, "colour: unknown key"),
    (BACKEND + 'kv_cache_mb = "lots"\n' + MODEL, "backends.local.kv_cache_mb: Expected `int`, got `str`"),
    (BACKEND + "flux = 2\n" + MODEL, "backends.local.flux: unknown key"),
    ('[backends.local]\ntype = "warp"\n' + MODEL, "backends.local.type: unknown backend type 'warp'"),
    ("[backends.local]\n" + MODEL, "backends.local.type: required"),
    (BACKEND + '[models.m]\nbackend = "remote"\n', "models.m.backend: no backend named 'remote'"),
    (BACKEND + MODEL + "aliases = [1]\n", "models.m.aliases[0]: Expected `str`, got `int`"),
    (BACKEND + MODEL + "max_input_tokens = 10\nmax_total_tokens = 5\n", "models.m.max_input_tokens: must be <"),
    (BACKEND + MODEL + '[models.n]\nbackend = "local"\naliases = ["m"]\n', "models.n.aliases[0]: name 'm' is already"),
    ('default_model = "x"\n' + BACKEND + MODEL, "default_model: no model named 'x'"),
    (BACKEND, "models: at least one"),
    ("[backends.local\n", "not valid TOML"),
    (BACKEND + "long_prefill_token_threshold = -1\n" + MODEL, "long_prefill_token_threshold` must be >= 0"),
])
def test_bad_config_names_the_key_path(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert message in str(info.value)


def test_check_config_prints_what_it_serves_and_fails_cleanly(tmp_path: Path) -> None:
    good = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(ROOT / "config.toml")],
                          capture_output=True, text=True, cwd=ROOT, timeout=WAIT)
    assert good.returncode == 0 and "model smollm2 (default) -> backend local (type engine)" in good.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text(BACKEND + 'kv_cache_mb = "lots"\n' + MODEL)
    for command in (["check-config", str(bad)], ["serve", "--config", str(bad)]):
        out = subprocess.run([sys.executable, "-m", "gateway", *command], capture_output=True, text=True, cwd=ROOT,
                             timeout=WAIT)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert "backends.local.kv_cache_mb: Expected `int`, got `str`" in out.stderr


def test_check_config_says_when_long_prompts_are_capped_a_step() -> None:
    config = parse_config(BACKEND + "long_prefill_token_threshold = 256\n" + MODEL)
    assert "at most 256 tokens of a prompt a step" in config.describe()


POOLS = """
default_model = "m"
[backends.fixed]
type = "openai"
model = "m"
endpoints = ["http://vllm-0:8000", "http://vllm-1:8000"]
[backends.dns]
type = "tgi"
base_url = "http://tgi-headless:80"
discovery = "dns"
balance = "least_load"
scrape_interval = 0
[backends.single]
type = "triton"
base_url = "http://triton:8000"
model = "m"
[backends.workers]
type = "engine"
model = "embedded"
replicas = 2
balance = "round_robin"
[models.m]
routes = [{ backend = "fixed", weight = 1 }, { backend = "dns", weight = 1 }, { backend = "single", weight = 1 },
          { backend = "workers", weight = 1 }]
"""


def test_check_config_describes_each_pool_and_its_balancing(tmp_path: Path) -> None:
    path = tmp_path / "pools.toml"
    path.write_text(POOLS)
    out = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=WAIT)
    assert out.returncode == 0, out.stderr
    lines = {line.split(":", 1)[0].strip(): line.split(":", 1)[1] for line in out.stdout.splitlines()
             if line.strip().startswith("backend ")}
    assert "a pool of 2 replicas (http://vllm-0:8000, http://vllm-1:8000); balance prefix (the replica holding " \
           ">= 0.3 of the prompt's blocks, unless loads differ by > 8 requests and > 1.5x while the busiest has " \
           "requests waiting); /metrics scraped " \
           "every 1 s" in lines["backend fixed (type openai)"]
    assert "every address of http://tgi-headless:80's host, resolved every 10 s; balance least_load; no scraping" \
        in lines["backend dns (type tgi)"]
    assert lines["backend single (type triton)"].strip() == "one server, http://triton:8000"
    assert "2 worker processes, balance round_robin" in lines["backend workers (type engine)"]


@pytest.fixture
def plugin_path(tmp_path: Path) -> Path:
    """A distribution on sys.path whose entry point registers the echo backend, as a pip install would."""
    dist = tmp_path / "site" / "llm_gateway_echo_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-gateway-echo-plugin\nVersion: 1.0\n")
    entry = "echo-test = tests.plugin.echo_backend:EchoBackend"
    (dist / "entry_points.txt").write_text(f"[llm_gateway.backends]\n{entry}\n")
    return tmp_path / "site"


PLUGIN_CONFIG = """
[backends.echo]
type = "echo-test"
start_delay = {delay}
start_gate = "{gate}"
accepts_chat = {chat}

[models.echo-model]
backend = "echo"
"""


def test_entry_point_backend_serves_both_protocols(plugin_path: Path, tmp_path: Path) -> None:
    config = PLUGIN_CONFIG.format(delay=0, gate="", chat="true")
    with running_gateway(config, tmp_path, env={"PYTHONPATH": str(plugin_path)}) as url:
        tgi = httpx.post(f"{url}/generate", json={"inputs": "one two three", "parameters": {"max_new_tokens": 5}},
                         timeout=CLIENT_TIMEOUT)
        assert tgi.json() == {"generated_text": "one two three"}
        chat = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "echo-model", "messages": [{"role": "user", "content": "hello plugin world"}]},
            timeout=CLIENT_TIMEOUT).json()
        # this backend takes chat natively: it saw the message, not a rendered template
        assert chat["choices"][0]["message"]["content"] == "hello plugin world"
        stream = httpx.post(f"{url}/generate_stream", json={"inputs": "a b"}, timeout=CLIENT_TIMEOUT).text
        assert stream.count("data: ") == 2 and '"generated_text":"a b"' in stream


def test_health_is_503_until_backends_are_ready_and_chat_is_templated(plugin_path: Path, tmp_path: Path) -> None:
    gate = tmp_path / "echo-may-start"  # the backend stays "starting" until the test creates this file
    config = PLUGIN_CONFIG.format(delay=0, gate=gate, chat="false")
    with running_gateway(config, tmp_path, env={"PYTHONPATH": str(plugin_path)}, wait_healthy=False) as url:
        early = httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT)
        assert early.status_code == 503  # TGI's body, plus what is not ready yet
        assert early.json() == {"error": "unhealthy", "error_type": "healthcheck", "draining": False,
                                "backends": {"echo": "starting"}}
        gate.touch()
        wait_until(lambda: httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT).status_code == 200, "healthy",
                   interval=0.2)
        chat = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "echo-model", "max_tokens": 50, "messages": [{"role": "user", "content": "hi there"}]},
            timeout=CLIENT_TIMEOUT).json()
        assert chat["choices"][0]["message"]["content"] == "user: hi there\n"  # the template, echoed back
