"""What dynamic int8 activations (W8A8) would cost in quality, before anyone writes the kernel.

The engine's int8 is weight-only: its kernels take bf16 (or fp32) activations. A W8A8 kernel (vpdpbusd, AMX-INT8)
would round each quantized layer's input to int8 first, with one scale per row (per token) or per block of
inputs, as llama.cpp does for its Q8_0 dot products (blocks of 32). This runs the real engine on the embedded
SmolLM2 with int8 weights and that rounding applied to every quantized layer's input (the LM head's too with
--head), teacher-forced over tests/data/public_domain.txt, and prints the perplexity against the bf16 path's and
how often the argmax agrees with it: the same measures as tests/test_quantization.py, whose bar for int8 is
perplexity within 1% and agreement within 5 points of fp32's own against bf16.

    .venv/bin/python benchmarks/activation_quant_quality.py --blocks 0 64 32
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_core.loader import resolve_model_dir  # noqa: E402
from engine_core.models.layers.linear import QuantLinear  # noqa: E402
from tests.test_quantization import TEXT, engine_for, perplexity, teacher_forced  # noqa: E402


def int8_rounded(x: torch.Tensor, block: int) -> torch.Tensor:
    """x with each row (block 0) or each block of a row rounded to int8 at scale max|x| / 127."""
    rows = x.float().reshape(-1, x.shape[-1])
    groups = rows.view(rows.shape[0], -1, block if block else rows.shape[1])
    scale = groups.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return (torch.round(groups / scale) * scale).view(x.shape).to(x.dtype)


def with_rounded_inputs(block: int, head: bool, run: Callable[[], torch.Tensor]) -> torch.Tensor:
    original = QuantLinear.__call__

    def rounded(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        is_head = self.dtype == torch.float32  # in a bf16 engine only the LM head writes fp32 (its logits)
        return original(self, x if is_head and not head else int8_rounded(x, block))

    QuantLinear.__call__ = rounded  # type: ignore[method-assign]
    try:
        return run()
    finally:
        QuantLinear.__call__ = original  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[0, 64, 32], help="0: one scale a row")
    parser.add_argument("--head", action="store_true", help="round the LM head's input too")
    args = parser.parse_args()
    model = str(resolve_model_dir("embedded"))
    ids = engine_for(model, "none").tokenize(TEXT)
    bf16 = teacher_forced(engine_for(model, "none"), ids)
    fp32 = teacher_forced(engine_for(model, "none", "float32"), ids)

    def report(name: str, scores: torch.Tensor) -> None:
        agreement = (scores.argmax(-1) == bf16.argmax(-1)).float().mean().item()
        print(f"{name}: perplexity {perplexity(scores, ids) / perplexity(bf16, ids):.4f}x bf16's, argmax agrees "
              f"with bf16 at {agreement:.3f} of {len(ids) - 1} positions", flush=True)

    report("fp32 weights and activations", fp32)
    int8 = engine_for(model, "int8")
    report("int8 weights, bf16 activations (the engine)", teacher_forced(int8, ids))
    for block in args.blocks:
        scores = with_rounded_inputs(block, args.head, lambda: teacher_forced(int8, ids))
        report(f"int8 weights, int8 activations {'per row' if block == 0 else f'per {block} inputs'}"
               f"{' (LM head too)' if args.head else ''}", scores)


if __name__ == "__main__":
    main()
