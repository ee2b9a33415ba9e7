"""Start a real gateway process on a free port for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROCESSES: dict[str, subprocess.Popen] = {}  # url → the gateway process serving it (to send it signals)

# The suite must pass on a slow or busy machine (2 cores, an engine 3x slower, other processes
# competing): no test asserts how long the system under test took. Clients wait generously (httpx's
# default is 5 s); a test's own wait for a state is bounded only by WAIT, to fail instead of hanging.
CLIENT_TIMEOUT = 120.0  # seconds, for every client request to a real server
WAIT = 120.0  # seconds: the bound of a polling loop waiting for a state
START_TIMEOUT = 600.0  # seconds for a gateway to become ready (the first start converts the model)


def wait_until(condition: Callable[[], Any], what: str, timeout: float = WAIT, interval: float = 0.05) -> Any:
    """Poll `condition` until it returns something truthy (returned); fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_gateway(config_text: str, tmp_dir: Path, *, env: dict[str, str] | None = None,
                    wait_healthy: bool = True, timeout: float = START_TIMEOUT) -> Iterator[str]:
    config = tmp_dir / "config.toml"
    config.write_text(config_text)
    port = free_port()
    log = open(tmp_dir / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(port),
                             "--log-level", "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            # state (rollouts.db, a default state.db) in the test's own folder, unless told otherwise
                            env={**os.environ, "LLMGW_STATE_DIR": str(tmp_dir / "state"), **(env or {})})
    url = f"http://127.0.0.1:{port}"
    PROCESSES[url] = proc
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}: {(tmp_dir / 'server.log').read_text()}")
            try:
                status = httpx.get(f"{url}/health", timeout=10).status_code
                if status == 200 or (status == 503 and not wait_healthy):
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway not ready: {(tmp_dir / 'server.log').read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        PROCESSES.pop(url, None)
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


ENGINE_CONFIG = """
default_model = "smollm2"

[backends.local]
type = "engine"
model = "embedded"
dtype = "float32"
kv_cache_mb = 256
max_num_seqs = 16

[models.smollm2]
backend = "local"
aliases = ["SmolLM2-135M-Instruct"]
max_input_tokens = 1024
max_total_tokens = 2048
default_max_new_tokens = 64
max_new_tokens = 1536
"""
