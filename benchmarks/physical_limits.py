"""The physical limits of a decode step on this machine, for docs/benchmarks.md: the time to stream the model's
weights once at the measured memory bandwidth (what batch-1 decode is bound by), and the step's matmul
FLOPs at the measured matmul rate (what big batches are bound by), next to the engine's measured step.

- bandwidth: the best of several passes summing a 1 GiB buffer (read-only, as a decode step reads weights);
- matmul rate: the peak, a 2048-cube GEMM per dtype; and what the step's own shapes ([B, in] x [in, out],
  each weight its own tensor, through the engine's Linear: oneDNN-packed for bf16) reach;
- the engine's decode step at the same batch (benchmarks/profile_step.py's forward + logits).

    .venv/bin/python benchmarks/physical_limits.py --batch 1 16 32 --dtype bfloat16 float32
    .venv/bin/python benchmarks/physical_limits.py --batch 1 16 --dtype bfloat16 --quantization none auto int8 int4

With --quantization, the bytes a step streams are those of the layers as loaded (codes, scales and mins of the
quantized ones, the LM head and the embedding table counted once when tied).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_vs_vllm import describe_cpu  # noqa: E402
from benchmarks.profile_step import decode_steps  # noqa: E402
from engine_core import EngineConfig, LLMEngine  # noqa: E402
from engine_core.loader import resolve_model_dir  # noqa: E402
from engine_core.models.layers.linear import Linear, QuantLinear  # noqa: E402


def read_bandwidth(gib: float = 1.0, passes: int = 5) -> float:
    """Bytes per second reading a buffer far larger than the caches."""
    buffer = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * 4 / best


def projection_shapes(engine: LLMEngine) -> list[tuple[int, int]]:
    """(in, out) of every matmul of a decode step: four fused projections per layer, and the LM head."""
    a = engine.model_args
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    per_layer = [(a.hidden_size, q + 2 * kv), (q, a.hidden_size), (a.hidden_size, 2 * a.intermediate_size),
                 (a.intermediate_size, a.hidden_size)]
    return per_layer * a.num_layers + [(a.hidden_size, a.vocab_size)]


def layer_bytes(model: object) -> int:
    """The bytes of every matmul weight of a decode step as loaded (quantized or not), found by walking the model's
    layers (families name their projections differently)."""
    seen: set[int] = set()

    def walk(obj: object, depth: int = 0) -> int:
        if id(obj) in seen or depth > 4:
            return 0
        seen.add(id(obj))
        if isinstance(obj, QuantLinear):
            return obj.nbytes
        if isinstance(obj, Linear):
            weight = next(t for t in (obj.blocks, obj.packed, obj.weight) if t is not None)
            return weight.numel() * weight.element_size()
        if isinstance(obj, (list, tuple)):
            return sum(walk(item, depth + 1) for item in obj)
        if hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
            return sum(walk(value, depth + 1) for value in vars(obj).values()) if hasattr(obj, "__dict__") else 0
        return 0

    return sum(walk(layer) for layer in model.layers) + walk(model.lm_head)  # type: ignore[attr-defined]


def peak_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 3) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best


def matmul_rate(shapes: list[tuple[int, int]], batch: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """FLOP/s over the step's distinct weights (each its own tensor, so none stays in cache)."""
    layers = [(Linear(torch.randn(out, fan_in).to(dtype) * 0.02), torch.randn(batch, fan_in).to(dtype))
              for fan_in, out in shapes]
    flops = sum(2 * batch * fan_in * out for fan_in, out in shapes)
    best = float("inf")
    for _ in range(repeats + 1):
        started = time.perf_counter()
        for linear, x in layers:
            linear(x)
        best = min(best, time.perf_counter() - started)
    return flops / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--quantization", nargs="+", default=None,
                        help="engine quantizations to measure (auto, none, int8, int4); the model's bytes as loaded")
    args = parser.parse_args()
    if args.quantization:
        quantized_steps(args)
        return
    print(describe_cpu(), f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    bandwidth = read_bandwidth()
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s", flush=True)
    model_dir = resolve_model_dir("embedded")
    for name in args.dtype:
        dtype = getattr(torch, name)
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=name, max_num_seqs=max(args.batch),
                                        kv_cache_bytes=512 * 2**20))
        shapes = projection_shapes(engine)
        weight_bytes = sum(fan_in * out for fan_in, out in shapes) * torch.finfo(dtype).bits // 8
        stream_ms = 1000 * weight_bytes / bandwidth
        peak = peak_rate(dtype)
        print(f"{name}: matmul weights {weight_bytes / 2**20:.0f} MiB, streamed once in {stream_ms:.1f} ms; "
              f"peak matmul rate {peak / 1e9:.0f} GFLOP/s", flush=True)
        for batch in args.batch:
            flops = sum(2 * batch * fan_in * out for fan_in, out in shapes)
            compute_ms = 1000 * flops / peak
            bound = max(stream_ms, compute_ms)
            shapes_ms = 1000 * flops / matmul_rate(shapes, batch, dtype)
            phases = decode_steps(engine, batch, args.steps, prompt_len=100)
            step = phases["forward"] + phases["logits"]
            print(f"  batch {batch:3d}: {flops / 1e9:.2f} GFLOP = {compute_ms:.1f} ms at peak; bound "
                  f"max(stream, compute) {bound:.1f} ms; the step's matmuls alone {shapes_ms:.1f} ms; "
                  f"engine step (forward + logits) {step:.1f} ms = {step / bound:.2f}x the bound", flush=True)
        del engine


def quantized_steps(args: argparse.Namespace) -> None:
    """Each quantization's batch-1 (and larger) step against the time to stream its bytes once."""
    print(describe_cpu(), f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    bandwidth = read_bandwidth()
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s", flush=True)
    for name in args.dtype:
        for quantization in args.quantization:
            engine = LLMEngine(EngineConfig(model="embedded", dtype=name, quantization=quantization,
                                            max_num_seqs=max(args.batch), kv_cache_bytes=512 * 2**20))
            nbytes = layer_bytes(engine.model)
            stream_ms = 1000 * nbytes / bandwidth
            paths = ", ".join(f"{n} {path}" for path, n in engine.model.linear_paths.items())
            print(f"{name} / {quantization}: {nbytes / 2**20:.0f} MiB of matmul weights ({paths}), streamed once "
                  f"in {stream_ms:.1f} ms", flush=True)
            for batch in args.batch:
                phases = decode_steps(engine, batch, args.steps, prompt_len=100)
                step = phases["forward"] + phases["logits"]
                print(f"  batch {batch:3d}: forward {phases['forward']:.1f} ms + logits {phases['logits']:.1f} ms "
                      f"= {step:.1f} ms = {step / stream_ms:.2f}x the stream bound; sample {phases['sample']:.2f} ms"
                      f", schedule+prepare+post {phases['schedule'] + phases['prepare'] + phases['post']:.2f} ms",
                      flush=True)
            del engine


if __name__ == "__main__":
    main()
