"""The compiled decoder stack against the Python layers, on one engine, in alternating rounds: the forward of a
decode step at each batch size with `model.stack` on, then off, round after round, so both see the same machine
(a noisy VM moves a step's time by 10-20% from minute to minute). Prints the median forward per round and the
median of the per-round ratios.

    .venv/bin/python benchmarks/decoder_stack.py --quantization auto int8 --batch 1 4 16
    .venv/bin/python benchmarks/decoder_stack.py --dtype bfloat16 --quantization none int8 auto --batch 1 4 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_vs_vllm import describe_cpu  # noqa: E402
from benchmarks.profile_step import decode_steps  # noqa: E402
from engine_core import EngineConfig, LLMEngine  # noqa: E402


def alternate(engine: LLMEngine, batch: int, rounds: int, steps: int) -> tuple[list[float], list[float]]:
    """Per round, the median forward (ms) with the stack, then without it."""
    model = engine.model
    stack = model.stack
    on: list[float] = []
    off: list[float] = []
    try:
        for _ in range(rounds):
            on.append(decode_steps(engine, batch, steps, prompt_len=100)["forward"])
            model.stack = None
            off.append(decode_steps(engine, batch, steps, prompt_len=100)["forward"])
            model.stack = stack
    finally:
        model.stack = stack
    return on, off


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", nargs="+", default=["auto"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    print(describe_cpu(), f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    for quantization in args.quantization:
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, quantization=quantization,
                                        max_num_seqs=max(args.batch), kv_cache_bytes=512 * 2**20))
        if engine.model.stack is None:
            print(f"{quantization}: this model has no compiled stack here", flush=True)
            continue
        for batch in args.batch:
            on, off = alternate(engine, batch, args.rounds, args.steps)
            ratios = [a / b for a, b in zip(on, off)]
            print(f"{args.dtype} / {quantization}, batch {batch:2d}: forward with the stack "
                  f"{statistics.median(on):.2f} ms, "
                  f"Python layers {statistics.median(off):.2f} ms; per-round ratio median "
                  f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}, {args.rounds} rounds "
                  f"of {args.steps} steps)", flush=True)
        del engine


if __name__ == "__main__":
    main()
