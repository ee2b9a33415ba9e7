"""Whether the quantized linear kernel (`linear_quant_`) is bound by its arithmetic or by memory, per row count.

One decode step's matmuls of SmolLM2-135M (fused q/k/v, o, fused gate/up and down in each of 30 layers) with
random weights quantized at load (int8 per output channel, int4 in groups of 32), bf16 activations, timed two ways:
- cached: one layer's four weights, again and again (they stay in L2/L3): the arithmetic's rate;
- streamed: 30 layers' own weights, as a step reads them (the model's bytes, from memory).
At one row a step that runs no faster cached than streamed is at its memory bound; the kernel's arithmetic only
matters where cached runs well ahead of streamed. Prints GB/s of weights read and GMAC/s.

With --against (another build's .so) the streamed pass runs on both builds in one process, alternating for
--rounds rounds: this VM's speed drifts by tens of percent between runs, far more than most kernel changes.

    .venv/bin/python benchmarks/quant_kernel_rates.py --quantization int8 int4 --rows 1 4 16
    .venv/bin/python benchmarks/quant_kernel_rates.py --rows 1 6 --against ~/.cache/torch_extensions/.../old.so
    .venv/bin/python benchmarks/quant_kernel_rates.py --dtype float32 --quantization int4 --rows 3 6 --against ...
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_spans import load_module  # noqa: E402
from benchmarks.engine_vs_vllm import describe_cpu  # noqa: E402
from benchmarks.linear_kernel import STEP_SHAPES  # noqa: E402
from engine_core.cpu.kernels import cpu_kernels  # noqa: E402
from engine_core.models.layers.quant import QuantizedTensor, quantize  # noqa: E402

LAYERS = 30
LAYER_SHAPES = [shape for shape, count in STEP_SHAPES.items() if count == LAYERS]  # (out, in); not the LM head


def step_time(kernels: object, layers: list[list[QuantizedTensor]], rows: int, repeats: int,
              dtype: torch.dtype = torch.bfloat16) -> float:
    """Median seconds for one pass over `layers` at `rows` rows, activations and outputs in `dtype`."""
    xs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in LAYER_SHAPES}}
    outs = {n: torch.empty(rows, n, dtype=dtype) for n, _ in LAYER_SHAPES}

    def one_pass() -> None:
        for layer in layers:
            for w, (n, k) in zip(layer, LAYER_SHAPES):
                kernels.linear_quant_(outs[n], 0, xs[k], w.codes, w.scales, w.mins, w.bits, w.group, None)

    one_pass()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--against", type=Path, help="another build's .so, its streamed pass measured beside this one")
    parser.add_argument("--rounds", type=int, default=8, help="with --against: alternating rounds")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="activations: float32 is what an AVX2-only CPU's engine runs")
    args = parser.parse_args()
    args.torch_dtype = getattr(torch, args.dtype)
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("no compiled kernels on this machine")
    print(describe_cpu(), f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    torch.manual_seed(0)
    for scheme in args.quantization:
        streamed = [[quantize(torch.randn(n, k) * 0.02, scheme) for n, k in LAYER_SHAPES] for _ in range(LAYERS)]
        step_bytes = sum(w.nbytes for layer in streamed for w in layer)
        macs = sum(n * k for n, k in LAYER_SHAPES) * LAYERS
        if args.against:
            compare(kernels, load_module(args.against), streamed, args)
            continue
        for rows in args.rows:
            # the cached pass runs one layer LAYERS times, so both passes do the same work
            cached_time = step_time(kernels, [streamed[0]] * LAYERS, rows, args.repeats, args.torch_dtype)
            streamed_time = step_time(kernels, streamed, rows, args.repeats, args.torch_dtype)
            print(f"{scheme}, {rows:2d} rows: cached {1e3 * cached_time:.2f} ms "
                  f"({step_bytes / cached_time / 1e9:.1f} GB/s, {rows * macs / cached_time / 1e9:.0f} GMAC/s), "
                  f"streamed {1e3 * streamed_time:.2f} ms ({step_bytes / streamed_time / 1e9:.1f} GB/s, "
                  f"{rows * macs / streamed_time / 1e9:.0f} GMAC/s); {step_bytes / 2**20:.0f} MiB a pass",
                  flush=True)


def compare(kernels: object, other: object, streamed: list[list[QuantizedTensor]], args: argparse.Namespace) -> None:
    """The streamed pass on this build and on `other`, alternating, median of the rounds per row count."""
    for rows in args.rows:
        this_times, other_times = [], []
        for i in range(args.rounds):
            order = [(this_times, kernels), (other_times, other)]
            for times, build in order if i % 2 == 0 else order[::-1]:
                times.append(step_time(build, streamed, rows, args.repeats, args.torch_dtype))
        this_ms, other_ms = 1e3 * statistics.median(this_times), 1e3 * statistics.median(other_times)
        print(f"{rows:2d} rows: this build {this_ms:.2f} ms, --against {other_ms:.2f} ms "
              f"({other_ms / this_ms:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
