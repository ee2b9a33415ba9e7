"""Prefix caching on and off, same run: a system prompt shared by every request, measured with
`llmgw bench` against the gateway's engine backend, plus the engine's prefix-cache hit rate.

    .venv/bin/python benchmarks/prefix_cache.py
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_vs_vllm import running_server  # noqa: E402
from engine_core.loader import resolve_model_dir  # noqa: E402

CONFIG = """
[backends.local]
type = "engine"
model = "embedded"
dtype = "bfloat16"
kv_cache_mb = 1024
max_num_seqs = 64
enable_prefix_caching = {caching}
[models.smollm2]
backend = "local"
"""


def counter(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}_total{{[^}}]*}} (\S+)$", text, re.M))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix-len", type=int, default=400)
    parser.add_argument("--input-len", type=int, default=450)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", default="8")
    parser.add_argument("--num-requests", default="48")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench-results" / "prefix")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for caching in ("false", "true"):
        config = args.out_dir / f"caching-{caching}.toml"
        config.write_text(CONFIG.format(caching=caching))
        url = "http://127.0.0.1:8413"
        command = [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", "8413",
                   "--log-level", "warning"]
        with running_server(f"caching {caching}", command, url, args.out_dir / f"caching-{caching}.log"):
            output = args.out_dir / f"caching-{caching}.json"
            subprocess.run([sys.executable, "-m", "gateway", "bench", "--url", url, "--api", "openai-completions",
                            "--tokenizer", str(resolve_model_dir("embedded")), "--prefix-len", str(args.prefix_len),
                            "--input-len", str(args.input_len - args.prefix_len), "--output-len", str(args.output_len),
                            "--ignore-eos", "--concurrency", args.concurrency, "--num-requests", args.num_requests,
                            "--warmup", "0", "--no-progress", "--no-plots", "--output", str(output)],
                           check=True, cwd=ROOT, capture_output=True)
            metrics = httpx.get(f"{url}/metrics").text
            queries = counter(metrics, "llmgw_engine_prefix_cache_queries")
            hits = counter(metrics, "llmgw_engine_prefix_cache_hits")
            summary = json.loads(output.read_text())["runs"][0]["summary"]
            print(f"prefix caching {caching:5}: TTFT p50 {summary['ttft_s']['p50'] * 1000:.0f} ms, "
                  f"p90 {summary['ttft_s']['p90'] * 1000:.0f} ms, total tok/s {summary['total_token_throughput']:.0f}, "
                  f"hit rate {hits / queries if queries else 0:.1%} ({hits:.0f}/{queries:.0f} blocks)", flush=True)

if __name__ == "__main__":
    main()
