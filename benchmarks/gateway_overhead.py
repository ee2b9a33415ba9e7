"""What the gateway costs: a fast mock OpenAI upstream hit directly, through this gateway (`openai`
backend) and through LiteLLM's proxy (one worker each), measured in one run.

    .venv/bin/python benchmarks/gateway_overhead.py --litellm-python .venv-litellm/bin/python

Measures, for each target: non-streaming latency at concurrency 1, streaming TTFT at concurrency 1,
and the saturated non-streaming request rate at concurrency 16.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MASTER_KEY = "sk-" + "5f" * 32  # LiteLLM refuses to start without one; every target gets the same header
BODY = {"model": "mock", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, path: str, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"port {port} not ready")


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,  # noqa: SIM115
                            env={**os.environ, **(env or {})})


async def measure(port: int, path: str, requests: int, seconds: float) -> dict[str, dict[str, float]]:
    whole = loadgen.build_request("127.0.0.1", port, path, json.dumps(BODY).encode(),
                                  {"authorization": f"Bearer {MASTER_KEY}"})
    stream = loadgen.build_request("127.0.0.1", port, path, json.dumps({**BODY, "stream": True}).encode(),
                                   {"authorization": f"Bearer {MASTER_KEY}"})
    await loadgen.run("127.0.0.1", port, whole, 4, count=100)  # warm-up
    out = {}
    out["c1_whole"] = (await loadgen.run("127.0.0.1", port, whole, 1, count=requests)).summary()
    out["c1_stream"] = (await loadgen.run("127.0.0.1", port, stream, 1, count=requests, marker=b"word0")).summary()
    out["c16_whole"] = (await loadgen.run("127.0.0.1", port, whole, 16, duration=seconds)).summary()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--litellm-python", default=None, help="python of a venv with litellm[proxy]")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--telemetry-variants", action="store_true",
                        help="also measure the gateway with telemetry off, and with tracing on (console exporter)")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="overhead-"))
    procs = []
    results: dict[str, dict] = {"date": time.strftime("%Y-%m-%d %H:%M"), "targets": {}}
    try:
        mock_port = free_port()
        procs.append(start([sys.executable, "benchmarks/mock_openai.py", "--port", str(mock_port)], logs / "mock.log"))
        wait_port(mock_port, "/v1/models")
        results["targets"]["direct"] = asyncio.run(measure(mock_port, "/v1/chat/completions", args.requests,
                                                           args.seconds))

        variants = {"llm-gateway": "", "gw-telemetry-off": "telemetry = false\n",
                    "gw-traces-on": 'traces = "console"\n'}
        for name, server in variants.items():
            if name != "llm-gateway" and not args.telemetry_variants:
                continue
            gw_port = free_port()
            config = logs / f"{name}.toml"
            config.write_text(f"[server]\n{server}\n[backends.mock]\ntype = \"openai\"\n"
                              f'base_url = "http://127.0.0.1:{mock_port}"\nmodel = "mock"\n\n'
                              f'[models.mock]\nbackend = "mock"\n')
            gw = start([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(gw_port),
                        "--log-level", "warning"], logs / f"{name}.log")
            procs.append(gw)
            wait_port(gw_port, "/health")
            results["targets"][name] = asyncio.run(measure(gw_port, "/v1/chat/completions", args.requests,
                                                           args.seconds))
            gw.terminate()

        if args.litellm_python:
            ll_port = free_port()
            ll_config = logs / "litellm.yaml"
            ll_config.write_text(f"model_list:\n  - model_name: mock\n    litellm_params:\n      model: openai/mock\n"
                                 f"      api_base: http://127.0.0.1:{mock_port}/v1\n      api_key: sk-mock\n")
            ll = start([args.litellm_python, "-m", "litellm.proxy.proxy_cli", "--config", str(ll_config), "--port",
                        str(ll_port), "--num_workers", "1"], logs / "litellm.log",
                       env={"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False", "LITELLM_MASTER_KEY": MASTER_KEY})
            procs.append(ll)
            wait_port(ll_port, "/health/liveliness", timeout=300)
            results["targets"]["litellm"] = asyncio.run(measure(ll_port, "/v1/chat/completions", args.requests,
                                                                args.seconds))
    finally:
        for proc in procs:
            proc.terminate()
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def report(results: dict) -> None:
    targets = results["targets"]
    direct = targets["direct"]
    print(f"{'target':<18} {'c1 p50 ms':>10} {'added ms':>9} {'c1 TTFT p50':>12} {'c16 req/s':>10} {'errors':>7}")
    for name, r in targets.items():
        added = r["c1_whole"]["latency_p50_ms"] - direct["c1_whole"]["latency_p50_ms"]
        errors = sum(int(v["errors"]) for v in r.values())
        print(f"{name:<18} {r['c1_whole']['latency_p50_ms']:>10.2f} {added:>9.2f} "
              f"{r['c1_stream']['ttft_p50_ms']:>12.2f} {r['c16_whole']['req_per_s']:>10.1f} {errors:>7}")
    if "litellm" in targets:
        ours, theirs = targets["llm-gateway"], targets["litellm"]
        ours_added = ours["c1_whole"]["latency_p50_ms"] - direct["c1_whole"]["latency_p50_ms"]
        theirs_added = theirs["c1_whole"]["latency_p50_ms"] - direct["c1_whole"]["latency_p50_ms"]
        print(f"added p50 latency: ours / LiteLLM's = {ours_added / theirs_added:.3f} (target <= 0.1)")
        print(f"saturated rate at c=16: ours / LiteLLM's = "
              f"{ours['c16_whole']['req_per_s'] / theirs['c16_whole']['req_per_s']:.1f}x (target >= 10)")


if __name__ == "__main__":
    main()
