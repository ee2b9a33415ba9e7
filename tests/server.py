"""Start a real gateway process on a free port for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROCESSES: dict[str, subprocess.Popen] = {}  # url → the gateway process serving it (to send it signals)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_gateway(config_text: str, tmp_dir: Path, *, env: dict[str, str] | None = None,
                    wait_healthy: bool = True, timeout: float = 180.0) -> Iterator[str]:
    config = tmp_dir / "config.toml"
    config.write_text(config_text)
    port = free_port()
    log = open(tmp_dir / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(port),
                             "--log-level", "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    PROCESSES[url] = proc
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}: {(tmp_dir / 'server.log').read_text()}")
            try:
                status = httpx.get(f"{url}/health", timeout=2).status_code
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
            proc.wait(20)
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
