"""The compiled bf16 linear layer (`linear_bf16`) against oneDNN's prepacked matmul, over one decode step's shapes.

For each row count, the time of one step's matmuls (SmolLM2-135M: fused q/k/v, o, fused gate/up and down in each
of 30 layers, and the LM head) through `engine_core.models.layers.linear.Linear` with the kernel and without it
(oneDNN's prepacked weight), at each torch thread count. The weights are random, one copy per shape, so they stay in the
CPU's caches: this isolates the kernels; `physical_limits.py` measures the engine's whole step, weights from memory.

    .venv/bin/python benchmarks/linear_kernel.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_vs_vllm import describe_cpu  # noqa: E402
from engine_core.cpu.kernels import cpu_kernels  # noqa: E402
from engine_core.models.layers.linear import Linear  # noqa: E402

# (out features, in features): how many of each one step runs
STEP_SHAPES = {(960, 576): 30, (576, 576): 30, (3072, 576): 30, (576, 1536): 30, (49152, 576): 1}


def seconds_per_call(layer: Linear, x: torch.Tensor, budget: float = 0.3) -> float:
    layer(x)
    calls, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < budget or calls < 3:
        layer(x)
        calls += 1
    return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None or not hasattr(kernels, "linear_bf16"):
        sys.exit("no linear_bf16 here: it needs AVX-512 BF16 and a C++ compiler")
    print(describe_cpu(), f"torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    weights = {shape: (torch.randn(*shape) * 0.05).bfloat16() for shape in STEP_SHAPES}
    ours = {shape: Linear(w, kernels=kernels) for shape, w in weights.items()}
    onednn = {shape: Linear(w) for shape, w in weights.items()}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            step = {"linear_bf16": 0.0, "oneDNN": 0.0}
            for shape, count in STEP_SHAPES.items():
                x = torch.randn(rows, shape[1]).bfloat16()
                step["linear_bf16"] += count * seconds_per_call(ours[shape], x)
                step["oneDNN"] += count * seconds_per_call(onednn[shape], x)
            print(f"{threads} thread(s), {rows:4d} rows: a step's matmuls take {1e3 * step['linear_bf16']:7.1f} ms "
                  f"with linear_bf16, {1e3 * step['oneDNN']:7.1f} ms with oneDNN "
                  f"({step['linear_bf16'] / step['oneDNN']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
