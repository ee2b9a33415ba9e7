"""One stream's decode attention at long contexts: the compiled paged kernel over a model's layers' caches, at several
key counts; GB/s of keys and values read. --shape picks the layers: SmolLM2-135M's (30 layers, 9 query heads, 3 KV
heads of 64) or Gemma 3 270M's (18 layers, 4 query heads, 1 KV head of 256). --rows N > 1 scores N rows of the one
sequence at once, the last N positions, as a speculative verify pass with N - 1 drafts does. --dtype: bf16 (the
AVX-512 BF16 path) or float32 (what an AVX2-only CPU serves, on the AVX2 build).

With --against, another build of the kernels (the .so of an earlier commit, as torch's extension cache keeps it:
~/.cache/torch_extensions/py311_cpu/llmgw_cpu_kernels_<march>_<hash>/) runs in the same process, the two
alternating round by round, so both see the same machine.

    .venv/bin/python benchmarks/attention_spans.py --keys 300 1000 4000
    .venv/bin/python benchmarks/attention_spans.py --dtype float32 --keys 300 1000 4000   # an AVX2-only CPU
    .venv/bin/python benchmarks/attention_spans.py --shape gemma3 --keys 500 1000 --rows 6
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

BLOCK = 16
SHAPES = {"smollm2": (30, 9, 3, 64), "gemma3": (18, 4, 1, 256)}  # layers, query heads, KV heads, head size


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
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--rows", type=int, default=1, help="rows of the one sequence a step scores")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the cache's and queries' dtype: float32 is what an AVX2-only CPU serves")
    args = parser.parse_args()
    layers_count, heads, kv_heads, head_dim = SHAPES[args.shape]
    builds = {"this build": cpu_kernels()}
    if builds["this build"] is None:
        raise SystemExit("no compiled kernels on this machine")
    if args.against:
        builds[args.against.stem] = load_module(args.against)
    print(describe_cpu(), f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.shape}, "
          f"{args.rows} row(s), {args.dtype}", flush=True)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(args.rows, heads, head_dim).to(dtype)
    for keys in args.keys:
        blocks = -(-keys // BLOCK)
        layers = [(torch.randn(blocks, BLOCK, kv_heads, head_dim).to(dtype),
                   torch.randn(blocks, BLOCK, kv_heads, head_dim).to(dtype),
                   torch.randperm(blocks).view(1, -1).expand(args.rows, -1).contiguous())
                  for _ in range(layers_count)]
        counts = torch.arange(keys - args.rows + 1, keys + 1)  # each row sees the keys up to its own
        times: dict[str, list[float]] = {name: [] for name in builds}
        for round_ in range(args.rounds):
            for name in list(builds)[:: 1 if round_ % 2 == 0 else -1]:
                decode = builds[name].paged_decode
                passes = []
                for _ in range(6):
                    started = time.perf_counter()
                    for k_cache, v_cache, table in layers:
                        decode(q, k_cache, v_cache, table, counts, head_dim ** -0.5, 0, 0.0)
                    passes.append(time.perf_counter() - started)
                times[name].append(statistics.median(passes[1:]))
        read = layers_count * 2 * keys * kv_heads * head_dim * dtype.itemsize  # each key and value once
        print(f"{keys:5d} keys: " + "; ".join(
            f"{name} {1e3 * statistics.median(t):.2f} ms ({read / statistics.median(t) / 1e9:.1f} GB/s)"
            for name, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
