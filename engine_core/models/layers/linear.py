"""Linear layers with the weight packed once at load time, for the fastest CPU matmul this machine has.

- bf16 on a CPU with AVX-512 BF16 (but no AMX) and the compiled kernels: the engine's own `linear_bf16`
  (`engine_core/cpu/csrc/linear_bf16.cpp`) over a weight packed in blocks of 16 output columns x 2 inputs.
  A decode step streams the weights at about memory bandwidth: a step's matmuls take 0.6x oneDNN's
  time (on its prepacked weight) at 1-2 rows, 0.8x at 4-16 on two threads, and level at prefill sizes
  (`benchmarks/linear_kernel.py`). The packed copy replaces the plain weight: memory stays the same.
- other bf16 on CPU: the weight reordered once into oneDNN's blocked layout, 1.1x (batch 128) to 1.9x
  (batch 1) faster than `F.linear` on the plain weight, with bit-identical results. On a CPU with AMX
  (Sapphire Rapids and later) this is the layers' path: `linear_bf16` runs 2 rows and more on the AMX tiles
  over its own layout (`linear_bf16_amx.cpp`) and takes 0.71-0.85x oneDNN's time for a step's matmuls from 1
  to 64 rows, but 1.39x at a 512-token prefill (`benchmarks/linear_kernel.py`, 2026-12-03), and keeping both
  layouts would double the weights' memory. The LM head, always on `linear_bf16`, gets the tiles.
- fp32 stays on `F.linear`: packing changes its rounding, and the fp32 path is the one checked token for
  token against transformers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
import torch.nn.functional as F

from engine_core.cpu.features import cpu_features
from engine_core.models.layers.quant import QuantizedTensor, cat_rows, same_layout

BLOCK = 16  # output columns per packed block: one AVX-512 vector of fp32 accumulators


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_blocks(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] → [ceil(N/16), K/2, 16, 2]: packed[b, k, j, t] = weight[16b + j, 2k + t], N padded with zeros."""
    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, -n % BLOCK))
    return padded.view(-1, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear_kernels(kernels: ModuleType | None) -> ModuleType | None:
    """The compiled kernels for the model's linear layers to use: none where oneDNN is faster (AMX)."""
    return None if cpu_features().amx_bf16 else kernels


class Linear:
    """`fp32_out`: the LM head, whose logits keep the matmul's fp32 sums in every dtype (bf16 logits would round
    values near 16 to multiples of 0.125, and greedy decoding would pick among false ties). On CPUs with AVX-512
    BF16 it runs on `linear_bf16`, AMX or not: oneDNN has no bf16 matmul with an fp32 result in torch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 kernels: ModuleType | None = None, fp32_out: bool = False) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None  # oneDNN's layout
        self.blocks: torch.Tensor | None = None  # linear_bf16's layout
        self.kernel = getattr(kernels, "linear_bf16", None)
        self.fp32_out = fp32_out and weight.dtype != torch.float32
        if not _can_pack(weight):
            return
        if self.kernel is not None and weight.shape[1] % 2 == 0:
            self.blocks = pack_blocks(weight)
            self.bias = None if bias is None else bias.float()  # widened once, not in every call
        elif self.fp32_out:
            return  # F.linear in fp32
        else:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            except RuntimeError:  # an old oneDNN or an unsupported shape: plain matmuls
                return
        self.weight = None  # the packed copy replaces it

    @property
    def path(self) -> str:
        """Which matmul runs, for the start log."""
        return "linear_bf16" if self.blocks is not None else "oneDNN packed" if self.packed is not None else "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            rows = x.reshape(-1, x.shape[-1])
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            out = self.kernel(rows, self.blocks, self.out_features, self.bias, self.fp32_out,
                              batch_rows(rows.shape[0]))
            return out.view(*x.shape[:-1], self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.fp32_out:
            assert self.weight is not None
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        return F.linear(x, self.weight, self.bias)


# Steps with more rows than this dequantize the weight and run the dtype's GEMM (AMX or AVX-512 for bf16):
# from there the matmul is compute-bound and the dequantize is shared by all rows (benchmarks/linear_kernel.py)
QUANT_KERNEL_MAX_ROWS = 16
# The AVX2 build's tile for 8+ rows reads weights widened once to fp32 (quant_tile_avx2.h) and beats the
# dequantize + fp32 GEMM up to ~128 rows: all of a Q4_1 step's layer matmuls at 64 rows took 94 against 123 ms,
# at 128 rows 192 against 199, at 256 rows 396 against 356 (AVX2 EPYC, 2026-12-06). fp32 activations only.
AVX2_FP32_QUANT_KERNEL_MAX_ROWS = 128
# From this many rows a step that holds no speculative verify pass runs its matmuls as a prefill does (QuantLinear,
# Linear, the compiled decoder stack's StackProjection and the LM head alike): scale-grouped quantized weights (4-bit,
# Q8_0-like) rounded to bf16 a block at a time (linear_quant_rows_), packed bf16 weights on linear_bf16's prefill
# tiles. The embedded Q4_1 model's forward at 8 / 10 / 12 / 14 / 16 rows: 15.95 / 18.25 / 19.31 / 18.98 / 21.87 ms
# rounded against 14.22 / 17.77 / 20.17 / 20.89 / 25.71 exact; its Q8_0 LM head 3.85 / 4.18 / 4.25 / 4.65 / 4.96
# against 4.03 / 4.53 / 5.14 / 5.70 / 6.34 (Zen 4, 2026-12-07, after the exact 4-bit tiles got faster from 5 rows).
# A verify pass keeps the exact kernels (a row's sums as a 1-row step's).
ROUNDED_MIN_ROWS = 12
_may_round = False  # set for a step by `rounding_allowed`


@contextmanager
def rounding_allowed(allowed: bool) -> Iterator[None]:
    """The step being computed holds no verify pass: its quantized matmuls of ROUNDED_MIN_ROWS-16 rows may round,
    and its bf16 ones take the prefill's tiles (a row's sums then are not a 1-row step's to the bit).
    One step runs at a time in an engine (as vLLM's forward context, it is the step's, not a layer's, setting)."""
    global _may_round
    previous, _may_round = _may_round, allowed
    try:
        yield
    finally:
        _may_round = previous


def batch_rows(rows: int) -> bool:
    """Whether a matmul of `rows` rows in the step being computed may run as a prefill's (rounding_allowed)."""
    return _may_round and rows >= ROUNDED_MIN_ROWS


class QuantLinear:
    """A linear layer over weights kept quantized (`quant.py`). A fused projection whose parts come in different
    formats (a GGUF's q, k and v) keeps one part per format, each writing its columns of one output."""

    def __init__(self, parts: list[QuantizedTensor], bias: torch.Tensor | None, kernels: ModuleType | None,
                 dtype: torch.dtype, fp32_out: bool = False) -> None:
        runs: list[list[QuantizedTensor]] = []  # consecutive parts of one layout become one part
        for part in parts:
            if runs and same_layout([runs[-1][0], part]):
                runs[-1].append(part)
            else:
                runs.append([part])
        self.parts = [cat_rows(run) for run in runs]
        self.columns = [0]
        for part in self.parts:
            self.columns.append(self.columns[-1] + part.shape[0])
        self.out_features = self.columns[-1]
        self.bias = None if bias is None else bias.float()
        # each part's kernel arguments after (out, col0, x), its slice of the bias cut once: a decode step makes
        # ~120 of these calls, and Python's share of each is most of a small layer's time
        self.part_args = [(col0, p.codes, p.scales, p.mins, p.bits, p.group,
                           None if self.bias is None else self.bias[col0:col0 + p.shape[0]])
                          for p, col0 in zip(self.parts, self.columns)]
        self.kernel = getattr(kernels, "linear_quant_", None)
        # more rows than the kernel serves: without AMX, linear_bf16's tiles over the weight dequantized a block at a
        # time (oneDNN would pack a dequantized weight again in every call); with AMX, its bf16 GEMM. The LM head's
        # fp32 logits take it only where a step may round (its prompt logprobs take the exact fp32 GEMM).
        self.rows_kernel = getattr(linear_kernels(kernels), "linear_quant_rows_", None)
        self.fp32_out = fp32_out
        self.dequantize_kernel = getattr(kernels, "dequantize_quant", None)
        avx2 = getattr(kernels, "compiled_isa", str)() == "avx2"
        self.fp32_max_rows = AVX2_FP32_QUANT_KERNEL_MAX_ROWS if avx2 else QUANT_KERNEL_MAX_ROWS
        self.dtype = torch.float32 if fp32_out else dtype
        # the kernel computes with the exact weights; a prefill-sized step's GEMM has them in the model's dtype
        # (bf16 on AMX), except the LM head's, fp32 for fp32 logits
        self.gemm_dtype = torch.float32 if fp32_out else dtype

    @property
    def path(self) -> str:
        formats = "+".join(sorted({p.format for p in self.parts}))
        return f"{formats} {'linear_quant' if self.kernel is not None else 'torch dequantize'}"

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.dequantize_kernel is None or self.parts[0].codes.device.type != "cpu":
            parts = [p.dequantize(dtype) for p in self.parts]
        else:
            parts = [self.dequantize_kernel(p.codes, p.scales, p.mins, p.bits, p.group, p.shape[1], dtype)
                     for p in self.parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        kernel, rounded = self.kernel, None  # rounded: the kernel for the parts with scale groups
        rows = x.shape[0]
        if (rows > QUANT_KERNEL_MAX_ROWS and self.rows_kernel is not None and x.dtype == torch.bfloat16
                and (_may_round or not self.fp32_out)):
            kernel = self.rows_kernel
        elif batch_rows(rows) and self.rows_kernel is not None and x.dtype == torch.bfloat16:
            rounded = self.rows_kernel  # the compiled decoder stack's rule (StackProjection), to the bit
        elif kernel is None or rows > (self.fp32_max_rows if x.dtype == torch.float32 else QUANT_KERNEL_MAX_ROWS):
            dtype = self.gemm_dtype
            out = F.linear(x.to(dtype), self.dequantized(dtype), None if self.bias is None else self.bias.to(dtype))
            return out.to(self.dtype)
        out = torch.empty((x.shape[0], self.out_features), dtype=self.dtype)  # the kernel runs on the CPU only
        for col0, codes, scales, mins, bits, group, bias in self.part_args:
            matmul = rounded if rounded is not None and group != x.shape[1] else kernel
            matmul(out, col0, x, codes, scales, mins, bits, group, bias)
        return out
