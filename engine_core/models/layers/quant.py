"""Weights kept quantized: one format for the int8 / int4 made at load and for GGUF's block formats.

A [N, K] weight is codes with a scale (and optionally a min) per group of inputs:

    w[n, k] = scales[n, g] * code[n, k] + mins[n, g]        g = k // group

- 8 bits: `codes` int8 [N, K]; groups of 16 (GGUF Q6_K), 32 (Q8_0, Q5_0) or the whole row (int8 per output
  channel, symmetric: no mins);
- 4 bits: `codes` uint8 [N, K/2], groups of 32, byte j of a group = code[j] | code[j + 16] << 4 (GGUF's Q4_0 and
  Q4_1 byte order, so those load as they are stored); int4 is asymmetric like Q4_1 (a scale and a min).

Every GGUF format listed in `engine_core/gguf_blocks.py` maps onto this exactly (a Q4_0 code q is q with min -8d,
Q6_K's is q - 32 with scale d*sc): the scales and mins are fp32, which holds each format's products exactly.
The compiled kernel (`engine_core/cpu/csrc/linear_quant.cpp`) reads this layout; `dequantize` is its reference.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

INT4_GROUP = 32
QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group: int
    format: str  # "int8", "int4", or the GGUF type it came from ("Q4_1"): the start log names it

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.codes.shape
        return n, width * 8 // self.bits

    @property
    def nbytes(self) -> int:
        """What a matmul reads: codes, scales and mins."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)

    def to(self, device: torch.device | str) -> QuantizedTensor:
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return replace(self, codes=move(self.codes), scales=move(self.scales), mins=move(self.mins))

    def select_rows(self, index: torch.Tensor) -> QuantizedTensor:
        """Rows (outputs) reordered or picked: a GGUF's permuted q/k rows, an embedding lookup."""
        pick = (lambda t: None if t is None else t[index].contiguous())  # noqa: E731
        return replace(self, codes=pick(self.codes), scales=pick(self.scales), mins=pick(self.mins))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [N, K] weight (the torch reference of the kernel's arithmetic, in fp32, then cast)."""
        n, k = self.shape
        codes = unpack_int4(self.codes) if self.bits == 4 else self.codes
        w = codes.float().view(n, k // self.group, self.group) * self.scales.view(n, -1, 1)
        if self.mins is not None:
            w = w + self.mins.view(n, -1, 1)
        return w.view(n, k).to(dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of an embedding table, dequantized: a step looks up a few rows, never the table."""
        return self.select_rows(ids.reshape(-1)).dequantize(dtype).view(*ids.shape, self.shape[1])


def same_layout(parts: list[QuantizedTensor]) -> bool:
    """Whether the parts of a fused projection concatenate into one tensor (one kernel call)."""
    first = parts[0]
    return all(p.bits == first.bits and p.group == first.group and (p.mins is None) == (first.mins is None)
               for p in parts[1:])


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    first = parts[0]
    formats = sorted({p.format for p in parts})
    return QuantizedTensor(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           None if first.mins is None else torch.cat([p.mins for p in parts]),  # type: ignore[misc]
                           first.bits, first.group, "+".join(formats))


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 → [N, K/2] bytes, per group of 32: byte j = code[j] | code[j + 16] << 4."""
    n, k = codes.shape
    grouped = codes.to(torch.uint8).view(n, k // 32, 2, 16)
    return (grouped[:, :, 0] | (grouped[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    grouped = packed.view(n, half // 16, 16)
    return torch.stack([grouped & 15, grouped >> 4], dim=2).reshape(n, half * 2)


def quantizable(weight: torch.Tensor) -> bool:
    """The kernel takes K in multiples of 32 (every model we serve); other weights stay in the dtype."""
    return weight.dim() == 2 and weight.shape[1] % 32 == 0


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Symmetric, one scale per output channel: code = round(w / scale), scale = max|w| / 127."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    codes = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedTensor(codes.contiguous(), scales.contiguous(), None, 8, w.shape[1], "int8")


def quantize_int4(weight: torch.Tensor) -> QuantizedTensor:
    """Asymmetric in groups of 32 (Q4_1's scheme): w ≈ min + scale * code, code 0..15. Each group takes the grid
    of the fewest squared errors among those spanning its range in L = 15, 14, ... steps: L = 15 is the plain
    min-max grid, and weights that already sit on a coarser grid (a checkpoint dequantized from 4 bits, whose
    group used fewer than 16 levels) are kept exactly rather than rounded onto a misaligned one."""
    n, k = weight.shape
    w = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo, span = w.amin(dim=2, keepdim=True), w.amax(dim=2, keepdim=True) - w.amin(dim=2, keepdim=True)
    best_err = torch.full(lo.shape, float("inf"))
    scales = torch.ones_like(lo)
    for levels in range(15, 3, -1):
        step = (span / levels).clamp_min(torch.finfo(torch.float32).tiny)
        codes = torch.round((w - lo) / step).clamp_(0, levels)
        err = (codes * step + lo - w).square_().sum(dim=2, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        scales = torch.where(better, step, scales)
    codes = torch.round((w - lo) / scales).clamp_(0, 15).view(n, k)
    return QuantizedTensor(pack_int4(codes), scales.view(n, -1).contiguous(), lo.view(n, -1).contiguous(), 4,
                           INT4_GROUP, "int4")


def quantize(weight: torch.Tensor, scheme: str) -> QuantizedTensor:
    return quantize_int8(weight) if scheme == "int8" else quantize_int4(weight)
