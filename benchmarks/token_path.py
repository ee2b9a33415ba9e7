"""What the gateway and the engine worker add to each token of one stream: the engine alone (an in-process
`LLMEngine` stepping one request) against the same model served by `llmgw serve` (engine worker process, streamed
`/v1/completions`), the same prompt and the same number of greedy tokens, alternating, in one run.

Per run: the median gap between consecutive steps (engine) or streamed tokens (gateway), after the first two; and
the CPU time per token of the gateway and the worker processes (the worker's includes its torch threads, which
spin). The difference of the medians is what the worker's event loop, ZeroMQ, the gateway and SSE add to a token
(issue 31: under 1 ms).

    .venv/bin/python benchmarks/token_path.py --quantization auto --tokens 128 --requests 6 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_vs_vllm import describe_cpu, wait_ready  # noqa: E402

CONFIG = """
default_model = "bench"

[backends.local]
type = "engine"
model = "{model}"
dtype = "auto"
quantization = "{quantization}"
kv_cache_mb = 512
max_num_seqs = 16

[models.bench]
backend = "local"
max_input_tokens = 2048
max_total_tokens = 4096
"""
PROMPT = " ".join(["The quick brown fox jumps over the lazy dog near the river bank today."] * 7)  # ~100 tokens
PORT = 8431


def steady_gap(stamps: list[float]) -> float:
    """The median gap between consecutive stamps, past the first token (prefill) and one more."""
    return statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:]))


def engine_alone(args: argparse.Namespace) -> list[float]:
    from engine_core import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization, max_num_seqs=16))
    gaps = []
    for i in range(args.requests + 1):  # the first warms up
        engine.add_request(f"r{i}", PROMPT, SamplingParams(max_new_tokens=args.tokens, ignore_eos=True))
        stamps = []
        while engine.has_unfinished():
            engine.step()
            stamps.append(time.perf_counter())
        if i:
            gaps.append(steady_gap(stamps))
    return gaps


def through_gateway(args: argparse.Namespace) -> tuple[list[float], list[float], list[float]]:
    """Token gaps, and the gateway's and the worker's CPU milliseconds per token, per request."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "gateway.toml"
        config.write_text(CONFIG.format(model=args.model, quantization=args.quantization))
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port",
                                 str(PORT), "--log-level", "warning"], cwd=ROOT, stdout=subprocess.DEVNULL)
        try:
            wait_ready(f"http://127.0.0.1:{PORT}", proc)
            gateway = psutil.Process(proc.pid)
            workers = gateway.children(recursive=True)
            body = {"model": "bench", "prompt": PROMPT, "max_tokens": args.tokens, "stream": True,
                    "ignore_eos": True, "temperature": 0}
            gaps, gateway_cpu, worker_cpu = [], [], []
            with httpx.Client(timeout=600) as client:
                for i in range(args.requests + 1):
                    before = [p.cpu_times() for p in (gateway, *workers)]
                    stamps = []
                    with client.stream("POST", f"http://127.0.0.1:{PORT}/v1/completions", json=body) as response:
                        response.raise_for_status()
                        for line in response.iter_lines():
                            if line.startswith("data: {"):
                                stamps.append(time.perf_counter())
                    after = [p.cpu_times() for p in (gateway, *workers)]
                    if i:
                        cpu = [(b.user + b.system - a.user - a.system) * 1000 / len(stamps)
                               for a, b in zip(before, after)]
                        gaps.append(steady_gap(stamps))
                        gateway_cpu.append(cpu[0])
                        worker_cpu.append(sum(cpu[1:]))
            return gaps, gateway_cpu, worker_cpu
        finally:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=6, help="per side and round, after one warm-up request")
    parser.add_argument("--rounds", type=int, default=2, help="engine, gateway, engine, gateway, ...")
    args = parser.parse_args()
    print(describe_cpu(), flush=True)
    engine_gaps, gateway_gaps, gateway_cpu, worker_cpu = [], [], [], []
    for round_ in range(args.rounds):
        engine_gaps += engine_alone(args)
        gaps, g_cpu, w_cpu = through_gateway(args)
        gateway_gaps += gaps
        gateway_cpu += g_cpu
        worker_cpu += w_cpu
        print(f"round {round_ + 1}: engine alone {statistics.median(engine_gaps[-args.requests:]) * 1000:.2f} ms a "
              f"step, through the gateway {statistics.median(gaps) * 1000:.2f} ms a token", flush=True)
    alone, served = statistics.median(engine_gaps) * 1000, statistics.median(gateway_gaps) * 1000
    print(f"\nquantization {args.quantization}, {args.tokens} tokens, {args.requests} x {args.rounds} requests a side")
    print(f"engine alone, step to step (ms):       p50 {alone:.2f}  (min {min(engine_gaps) * 1000:.2f}, "
          f"max {max(engine_gaps) * 1000:.2f})")
    print(f"through the gateway, token to token:   p50 {served:.2f}  (min {min(gateway_gaps) * 1000:.2f}, "
          f"max {max(gateway_gaps) * 1000:.2f})")
    print(f"added per token:                       {served - alone:+.2f} ms ({served / alone:.2f}x)")
    print(f"CPU per token: gateway {statistics.median(gateway_cpu):.2f} ms, worker {statistics.median(worker_cpu):.2f}"
          " ms (its torch threads included)")


if __name__ == "__main__":
    main()
