"""First start (GGUF → safetensors conversion into an empty cache) vs later starts (from the cache).

    .venv/bin/python benchmarks/load_time.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("import time; t=time.perf_counter(); from engine_core import EngineConfig, LLMEngine; "
        "e=LLMEngine(EngineConfig(num_blocks=64)); print(f'{time.perf_counter()-t:.2f}')")


def start_seconds(cache: str) -> float:
    import os

    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "LLMGW_MODEL_CACHE": cache})
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        wall = time.perf_counter()
        first = start_seconds(cache)
        print(f"first start (convert GGUF into an empty cache, then load): {first:.1f}s "
              f"(process wall {time.perf_counter() - wall:.1f}s)")
        later = [start_seconds(cache) for _ in range(3)]
        print("later starts (load from cache): " + ", ".join(f"{s:.1f}s" for s in later))


if __name__ == "__main__":
    main()
