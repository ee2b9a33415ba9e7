"""One stream's decode attention at long contexts: the compiled bf16 paged kernel over 30 layers' caches (SmolLM2-135M's
shapes: 9 query heads, 3 KV heads of 64), one row, at several key counts; GB/s of keys and values read.

With --against, another build of the kernels (the .so of an earlier commit, as torch's extension cache keeps it:
~/.cache/torch_extensions/py311_cpu/llmgw_cpu_kernels_<march>_<hash>/) runs in the same process, the two
alternating round by round, so both see the same machine.

    .venv/bin/python benchmarks/attention_spans.py --keys 300 1000 4000
    .venv/bin/python benchmarks/attention_spans.py --against \
        ~/.cache/torch_extensions/py311_cpu/llmgw_cpu_kernels_cooperlake_46ff20b813/llmgw_cpu_kernels_cooperlake_46ff20b813.so
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_vs_vllm import describe_cpu  # noqa: E402
from engine_core.cpu.kernels import cpu_kernels  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[300, 600, 1000, 2000, 4000])
    parser.add_argument("--against", type=Path, help="another build's .so, measured beside this one")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    builds = {"this build": cpu_kernels()}
    if builds["this build"] is None:
        raise SystemExit("no compiled kernels on this machine")
    if args.against:
        builds[args.against.stem] = load_module(args.against)
    print(describe_cpu(), f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, HEAD_DIM).to(torch.bfloat16)
    for keys in args.keys:
        blocks = -(-keys // BLOCK)
        layers = [(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(torch.bfloat16),
                   torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(torch.bfloat16),
                   torch.randperm(blocks).view(1, -1)) for _ in range(LAYERS)]
        counts = torch.tensor([keys])
        times: dict[str, list[float]] = {name: [] for name in builds}
        for round_ in range(args.rounds):
            for name in list(builds)[:: 1 if round_ % 2 == 0 else -1]:
                decode = builds[name].paged_decode
                passes = []
                for _ in range(6):
                    started = time.perf_counter()
                    for k_cache, v_cache, table in layers:
                        decode(q, k_cache, v_cache, table, counts, HEAD_DIM ** -0.5, 0, 0.0)
                    passes.append(time.perf_counter() - started)
                times[name].append(statistics.median(passes[1:]))
        read = LAYERS * 2 * keys * KV_HEADS * HEAD_DIM * 2
        print(f"{keys:5d} keys: " + "; ".join(
            f"{name} {1e3 * statistics.median(t):.2f} ms ({read / statistics.median(t) / 1e9:.1f} GB/s)"
            for name, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
