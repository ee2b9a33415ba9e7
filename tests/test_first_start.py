"""The first start on a fresh machine says what it is doing: each long step is logged before and after
with its duration, and /health's 503 names the step a starting engine is in."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.server import CLIENT_TIMEOUT, ENGINE_CONFIG, START_TIMEOUT, running_gateway, wait_until


def test_first_start_logs_each_step_and_health_names_it(tmp_path: Path) -> None:
    fresh_cache = {"LLMGW_MODEL_CACHE": str(tmp_path / "models")}  # as on a new machine: converted first
    states: list[str] = []

    def served() -> bool:
        r = httpx.get(f"{url}/health", timeout=CLIENT_TIMEOUT)
        if r.status_code == 503:
            body = r.json()
            assert body["error"] == "unhealthy" and body["error_type"] == "healthcheck" and not body["draining"]
            states.append(body["backends"]["local"])
        return r.status_code == 200

    with running_gateway(ENGINE_CONFIG, tmp_path, env=fresh_cache, wait_healthy=False) as url:
        wait_until(served, "the engine serves", timeout=START_TIMEOUT, interval=0.2)
        info = httpx.get(f"{url}/info", timeout=CLIENT_TIMEOUT).json()
        log = (tmp_path / "server.log").read_text()
    # the conversion alone takes many seconds, so /health was polled during it
    assert any(re.fullmatch(r"starting: converting the embedded SmolLM2-135M-Instruct into .* \(once\) "
                            r"\(\d+ s so far\)", s) for s in states), states
    for step in ("converting the embedded SmolLM2-135M-Instruct", "loading the tokenizer", "loading weights",
                 "allocating the KV cache"):
        assert re.search(rf"{step}.* \.\.\.$", log, re.M), step
        assert re.search(rf"{step}.*: done in \d+\.\d s", log), step
    assert re.search(r"allocating the KV cache: done in \d+\.\d s; \d+ blocks of 16 tokens = \d+ tokens, \d+ MiB",
                     log)
    assert re.search(r"engine: dtype float32 \(set in the config\) on cpu; CPU .*; path \w+\)", log)
    # fp32: the compiled attention and layer ops, and the layers in one compiled call for small steps
    assert "attention cpu-paged, layer ops FusedLayerOps, decoder layers compiled decoder stack" in log
    assert (info["model_dtype"], info["dtype_reason"]) == ("float32", "set in the config")
    assert (tmp_path / "models" / "SmolLM2-135M-Instruct" / "config.json").is_file()
