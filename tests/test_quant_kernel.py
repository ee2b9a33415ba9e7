"""The quantized weights' pieces against their references: the compiled `linear_quant_` (each ISA build this CPU
runs) against x @ dequantize(W)ᵀ in fp32 over odd shapes, the torch fallback layer, the int8 / int4 quantizers,
and the GGUF block decoders against gguf-py's own dequantization."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from engine_core.cpu.features import cpu_features
from engine_core.gguf_blocks import DECODERS, decode
from engine_core.models.layers.linear import (
    QUANT_KERNEL_MAX_ROWS,
    ROUNDED_MIN_ROWS,
    QuantLinear,
    linear_kernels,
    pack_blocks,
    rounding_allowed,
)
from engine_core.models.layers.quant import (
    QuantizedTensor,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from tests.kernel_helpers import ISAS, assert_only_a_batch_step_takes, assert_rows_get_their_one_row_sums, kernels_for


def random_quantized(n: int, k: int, bits: int, group: int, with_mins: bool, seed: int) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    mins = -torch.rand(n, k // group, generator=g) * 0.1 if with_mins else None
    return QuantizedTensor(codes, scales, mins, bits, group, f"test{bits}")


FORMATS = [  # (bits, group or None for the whole row, mins): int8, Q6_K, Q8_0 / Q5_0, int4 / Q4_*
    (8, None, False), (8, 16, False), (8, 32, False), (4, 32, True), (4, 32, False), (8, 32, True)]
SHAPES = [(1, 32, 1), (1, 576, 960), (3, 96, 37), (5, 1536, 64), (13, 64, 130), (16, 576, 7), (11, 96, 37),
          (10, 32, 8), (100, 96, 37)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group", "mins"), FORMATS)
@pytest.mark.parametrize(("rows", "k", "n"), SHAPES)
def test_linear_quant_matches_the_dequantized_matmul(isa: str, bits: int, group: int | None, mins: bool,
                                                     rows: int, k: int, n: int) -> None:
    kernels = kernels_for(isa)
    w = random_quantized(n, k, bits, group or k, mins, seed=rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).bfloat16()
    bias = torch.randn(n) if n % 2 else None
    want = x.float() @ w.dequantize().t() + (0 if bias is None else bias)
    # fp32 out, written at an offset into a wider output (a fused projection's later part)
    out = torch.full((rows, n + 5), float("nan"))
    kernels.linear_quant_(out, 3, x, w.codes, w.scales, w.mins, bits, group or k, bias)
    torch.testing.assert_close(out[:, 3:3 + n], want, rtol=1e-5, atol=1e-4)
    assert out[:, :3].isnan().all() and out[:, 3 + n:].isnan().all()  # nothing outside its columns
    # bf16 out: the fp32 sums rounded once
    out16 = torch.empty(rows, n, dtype=torch.bfloat16)
    kernels.linear_quant_(out16, 0, x, w.codes, w.scales, w.mins, bits, group or k, bias)
    torch.testing.assert_close(out16.float(), want, rtol=2 ** -8, atol=1e-3)
    # fp32 activations (an fp32 model) meet the same exact weights
    kernels.linear_quant_(out, 3, x.float(), w.codes, w.scales, w.mins, bits, group or k, bias)
    torch.testing.assert_close(out[:, 3:3 + n], want, rtol=1e-5, atol=1e-4)


def fp32_sums(kernels: ModuleType, w: QuantizedTensor, bias: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A step of `linear_quant_` over some rows of x: their fp32 sums, before any rounding to bf16."""
    def sums(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], w.codes.shape[0])
        kernels.linear_quant_(out, 0, rows.contiguous(), w.codes, w.scales, w.mins, w.bits, w.group, bias)
        return out
    return sums


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group", "mins"), FORMATS)
def test_a_row_gets_the_same_fp32_sums_wherever_it_sits_in_a_big_step(isa: str, bits: int, group: int | None,
                                                                      mins: bool) -> None:
    """Steps of 8 and more rows read weights widened once for all their rows (the AVX2 build), in blocks of 4 rows:
    a row's sums must not depend on the step's other rows or on its block, so a batch's logits do not move as
    requests join and leave it; and a 4-row step agrees within fp32 rounding."""
    k, n = 192, 45
    sums = fp32_sums(kernels_for(isa), random_quantized(n, k, bits, group or k, mins, seed=7), torch.randn(n))
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(3))
    eight, twelve = sums(x[:8]), sums(x[:12])
    assert torch.equal(twelve[:8], eight)
    assert torch.equal(sums(torch.cat([x[4:8], x[:4]])), torch.cat([eight[4:], eight[:4]]))
    torch.testing.assert_close(sums(x[4:8]), eight[4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("isa", "dtype"), [("avx512_bf16", torch.bfloat16), ("avx2", torch.float32)])
@pytest.mark.parametrize(("bits", "group", "mins"), FORMATS)
def test_a_row_gets_its_one_row_sums_in_every_verify_sized_step(isa: str, dtype: torch.dtype, bits: int,
                                                                group: int | None, mins: bool) -> None:
    """A row's sums in a step of 2 to n rows are its sums in a 1-row step, to the bit, so a speculative verify pass
    (1 + k rows) scores each position as a plain decode step does and greedy output stays the same with drafts on.
    bf16 activations on the AVX-512 BF16 build: n = 16 (with AMX, steps of more than 4 rows run on its tiles
    instead); fp32 activations on the AVX2 build: n = 7 (up to 6 drafts), in blocks of up to 3 rows."""
    kernels = kernels_for(isa)
    most = 7 if isa == "avx2" else 4 if cpu_features().amx_bf16 else QUANT_KERNEL_MAX_ROWS
    k, n = 576, 45
    sums = fp32_sums(kernels, random_quantized(n, k, bits, group or k, mins, seed=11), torch.randn(n))
    assert_rows_get_their_one_row_sums(sums, torch.randn(most, k, generator=torch.Generator().manual_seed(5)).to(dtype))


ROWS_SHAPES = [(17, 64, 16), (33, 576, 37), (100, 96, 130), (25, 1536, 64)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group", "mins"), FORMATS)
@pytest.mark.parametrize(("rows", "k", "n"), ROWS_SHAPES)
def test_prefill_quant_kernel_matches_the_bf16_rounded_matmul(isa: str, bits: int, group: int | None, mins: bool,
                                                              rows: int, k: int, n: int) -> None:
    """`linear_quant_rows_` (AVX-512 BF16 builds): the weight rounded to bf16, as the dequantize-then-GEMM path
    rounds it, on bf16 tiles; odd row and column counts, a part written at a column offset."""
    kernels = kernels_for(isa)
    if not hasattr(kernels, "linear_quant_rows_"):
        pytest.skip(f"the {isa} build has no prefill kernel")
    w = random_quantized(n, k, bits, group or k, mins, seed=rows + k + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    bias = torch.randn(n) if n % 2 else None
    want = x.float() @ w.dequantize().bfloat16().float().t() + (0 if bias is None else bias)
    out = torch.full((rows, n + 5), float("nan"))
    kernels.linear_quant_rows_(out, 3, x, w.codes, w.scales, w.mins, bits, group or k, bias)
    torch.testing.assert_close(out[:, 3:3 + n], want, rtol=2 ** -8, atol=1e-2)
    assert out[:, :3].isnan().all() and out[:, 3 + n:].isnan().all()
    out16 = torch.empty(rows, n, dtype=torch.bfloat16)
    kernels.linear_quant_rows_(out16, 0, x, w.codes, w.scales, w.mins, bits, group or k, bias)
    torch.testing.assert_close(out16.float(), want, rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize(("bits", "group", "mins"), FORMATS)
@pytest.mark.parametrize(("rows", "k", "n"), ROWS_SHAPES)
def test_prefill_quant_kernel_gives_linear_bf16_sums_over_the_dequantized_weight(
        bits: int, group: int | None, mins: bool, rows: int, k: int, n: int) -> None:
    """The blocks `linear_quant_rows_` dequantizes in cache are, to the bit, the compiled `dequantize_quant`'s bf16
    weight packed as `linear_bf16` packs it at load: the same tiles over them give the same sums."""
    kernels = kernels_for("avx512_bf16")
    if cpu_features().amx_bf16:
        pytest.skip("linear_bf16 runs these rows on the AMX tiles here, in another order")
    w = random_quantized(n, k, bits, group or k, mins, seed=rows + k + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    out = torch.empty(rows, n)
    kernels.linear_quant_rows_(out, 0, x, w.codes, w.scales, w.mins, bits, group or k, None)
    weight = kernels.dequantize_quant(w.codes, w.scales, w.mins, bits, group or k, k, torch.bfloat16)
    assert torch.equal(out, kernels.linear_bf16(x, pack_blocks(weight), n, None, True))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("bits", "group", "mins"), FORMATS)
def test_dequantize_kernel_is_the_reference_dequantization(isa: str, bits: int, group: int | None,
                                                           mins: bool) -> None:
    kernels = kernels_for(isa)
    w = random_quantized(37, 96, bits, group or 96, mins, seed=7)
    got = kernels.dequantize_quant(w.codes, w.scales, w.mins, bits, group or 96, 96, torch.float32)
    torch.testing.assert_close(got, w.dequantize(), rtol=1e-6, atol=1e-7)
    got16 = kernels.dequantize_quant(w.codes, w.scales, w.mins, bits, group or 96, 96, torch.bfloat16)
    assert torch.equal(got16, w.dequantize().bfloat16()) or torch.allclose(got16.float(), w.dequantize(),
                                                                            rtol=2 ** -8, atol=0)


def test_linear_quant_refuses_shapes_it_cannot_read() -> None:
    kernels = kernels_for(ISAS[-1])
    w = random_quantized(8, 64, 8, 32, False, seed=1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.linear_quant_(torch.empty(1, 8), 0, torch.randn(1, 48), w.codes[:, :48].contiguous(),
                              w.scales[:, :1].contiguous(), None, 8, 48, None)
    wide = random_quantized(8, 96, 8, 32, False, seed=2)
    with pytest.raises(RuntimeError, match="groups of 16, 32 or the whole row"):
        kernels.linear_quant_(torch.empty(1, 8), 0, torch.randn(1, 96), wide.codes, wide.scales[:, :2].contiguous(),
                              None, 8, 48, None)
    with pytest.raises(RuntimeError, match="outside out"):
        kernels.linear_quant_(torch.empty(1, 8), 4, torch.randn(1, 64), w.codes, w.scales, None, 8, 32, None)


@pytest.mark.parametrize("rows", [1, QUANT_KERNEL_MAX_ROWS, QUANT_KERNEL_MAX_ROWS + 9])
@pytest.mark.parametrize("with_kernels", [True, False])
def test_quant_linear_over_mixed_parts_matches_the_dequantized_layer(rows: int, with_kernels: bool) -> None:
    """A fused q|k|v whose parts come in different formats (a GGUF's Q4_K q, k beside a Q6_K v): one output,
    each part's columns, on the kernel (decode), on the dequantized GEMM (prefill) and in torch (no compiler)."""
    parts = [random_quantized(64, 96, 4, 32, True, 1), random_quantized(32, 96, 4, 32, True, 2),
             random_quantized(32, 96, 8, 16, False, 3)]
    layer = QuantLinear(parts, torch.randn(128), kernels_for(ISAS[-1]) if with_kernels else None, torch.bfloat16)
    assert len(layer.parts) == 2  # the two 4-bit parts concatenated, the 8-bit one its own
    x = torch.randn(rows, 96).bfloat16()
    weight = torch.cat([p.dequantize() for p in parts])
    if rows > QUANT_KERNEL_MAX_ROWS or not with_kernels:
        weight = weight.bfloat16().float()  # the GEMM's (and torch's) bf16 weights; the kernel's are exact
    want = x.float() @ weight.t() + layer.bias
    got = layer(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=2e-2)
    head = QuantLinear(parts, None, kernels_for(ISAS[-1]) if with_kernels else None, torch.bfloat16, fp32_out=True)
    logits = head(x)  # the exact weights and fp32 sums on every path
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ torch.cat([p.dequantize() for p in parts]).t(), rtol=1e-5,
                               atol=1e-4)


@pytest.mark.parametrize("rows", [ROUNDED_MIN_ROWS - 1, ROUNDED_MIN_ROWS, QUANT_KERNEL_MAX_ROWS])
def test_a_step_without_a_verify_pass_runs_scale_grouped_parts_as_a_prefill_does(rows: int) -> None:
    """From ROUNDED_MIN_ROWS rows a step that speculates nothing may round 4-bit (and other scale-grouped) weights to
    bf16 as a prefill does (linear_quant_rows_, faster there); a verify pass's rows keep the exact weights and each
    gets what it gets alone, and one scale a row (int8) stays exact either way."""
    kernels = kernels_for("avx512_bf16")
    if linear_kernels(kernels) is None:
        pytest.skip("AMX: the rows path is oneDNN's")
    parts = [random_quantized(64, 576, 4, 32, True, 1), random_quantized(32, 576, 8, 576, False, 2)]  # Q4_1 | int8
    layer = QuantLinear(parts, None, kernels, torch.bfloat16)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()

    def by_kernel(kernel, part: int) -> torch.Tensor:
        col0, codes, scales, mins, bits, group, bias = layer.part_args[part]
        out = torch.empty(rows, codes.shape[0], dtype=torch.bfloat16)
        kernel(out, 0, x, codes, scales, mins, bits, group, bias)
        return out

    exact = layer(x)
    assert torch.equal(exact, torch.cat([layer(x[i:i + 1]) for i in range(rows)]))  # a verify pass's rows
    with rounding_allowed(True):
        rounded = layer(x)
    four_bit = rounded[:, :64]
    if rows < ROUNDED_MIN_ROWS:
        assert torch.equal(rounded, exact)
    else:
        assert torch.equal(four_bit, by_kernel(kernels.linear_quant_rows_, 0))
        assert not torch.equal(four_bit, exact[:, :64])
    assert torch.equal(rounded[:, 64:], exact[:, 64:])  # int8, one scale a row
    torch.testing.assert_close(four_bit.float(), exact[:, :64].float(), rtol=2 ** -6, atol=2e-2)


@pytest.mark.parametrize("rows", [ROUNDED_MIN_ROWS - 1, ROUNDED_MIN_ROWS, QUANT_KERNEL_MAX_ROWS, 24])
def test_a_quantized_lm_head_rounds_only_in_a_step_without_a_verify_pass(rows: int) -> None:
    """The LM head (fp32 logits) follows its layers' rule: a step that speculates nothing may take its Q8_0 weight
    rounded to bf16 from ROUNDED_MIN_ROWS rows (fp32 sums and fp32 logits still); a verify pass's rows, and more rows
    than the kernel serves outside such a step (prompt logprobs), get the exact weights."""
    kernels = kernels_for("avx512_bf16")
    if linear_kernels(kernels) is None:
        pytest.skip("AMX: the rows path is oneDNN's")
    head = QuantLinear([random_quantized(80, 576, 8, 32, False, 3)], None, kernels, torch.bfloat16, fp32_out=True)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    torch.testing.assert_close(head(x), x.float() @ head.dequantized(torch.float32).t(), rtol=1e-5, atol=1e-4)

    def by_kernel() -> torch.Tensor:
        col0, codes, scales, mins, bits, group, bias = head.part_args[0]
        out = torch.empty(rows, 80)
        kernels.linear_quant_rows_(out, 0, x, codes, scales, mins, bits, group, bias)
        return out

    rounded = assert_only_a_batch_step_takes(by_kernel, head, x)
    assert rounded.dtype == torch.float32
    if rows >= ROUNDED_MIN_ROWS:
        torch.testing.assert_close(rounded, x.float() @ head.dequantized(torch.bfloat16).float().t(), rtol=1e-5,
                                   atol=1e-4)


def test_int8_quantizer_rounds_each_weight_to_its_channel_step() -> None:
    w = torch.randn(64, 96) * torch.linspace(0.01, 2, 64)[:, None]
    q = quantize_int8(w)
    assert q.bits == 8 and q.group == 96 and q.mins is None and q.codes.dtype == torch.int8
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert q.codes.abs().max() == 127  # the largest weight of each row hits the end of the range


def test_int4_quantizer_errs_less_than_the_min_max_grid_and_keeps_a_coarser_grid_exactly() -> None:
    w = torch.randn(16, 128)
    q = quantize_int4(w)
    assert q.bits == 4 and q.group == 32 and q.codes.shape == (16, 64)
    groups = w.view(16, 4, 32)
    lo, hi = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
    step = (hi - lo) / 15
    min_max = torch.round((groups - lo) / step) * step + lo
    err = (q.dequantize().view(16, 4, 32) - groups).square().sum(dim=2)
    assert (err <= (min_max - groups).square().sum(dim=2) + 1e-6).all()
    # weights already on a 4-bit grid using 11 of its levels (a checkpoint dequantized from Q4_1) come back exactly
    grid = torch.randint(0, 11, (16, 4, 32)).float() * torch.rand(16, 4, 1) * 0.1 - torch.rand(16, 4, 1)
    torch.testing.assert_close(quantize_int4(grid.view(16, 128)).dequantize(), grid.view(16, 128), rtol=0, atol=1e-6)
    assert torch.equal(unpack_int4(pack_int4(torch.arange(32).remainder(16).repeat(2, 1))),
                       torch.arange(32).remainder(16).repeat(2, 1).to(torch.uint8))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_gguf_block_decoders_match_gguf_py(kind: str) -> None:
    from gguf import GGMLQuantizationType, dequantize, quantize

    data = np.random.default_rng(0).standard_normal((24, 256)).astype(np.float32)
    raw = quantize(data, GGMLQuantizationType[kind])
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))
    got = decode(raw, kind)
    assert got.format == kind
    assert torch.equal(got.dequantize(), want)


def test_gguf_k_quant_decoders_match_gguf_py_on_gemma3(gemma3_gguf: Path) -> None:
    from gguf import GGUFReader, dequantize

    seen: set[str] = set()
    for tensor in GGUFReader(gemma3_gguf).tensors:
        kind = tensor.tensor_type.name
        if kind in DECODERS and kind not in seen and len(tensor.shape) == 2:
            seen.add(kind)
            raw = np.asarray(tensor.data)
            want = torch.from_numpy(dequantize(raw, tensor.tensor_type).astype(np.float32)).view(raw.shape[0], -1)
            assert torch.equal(decode(raw, kind).dequantize(), want), tensor.name
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= seen
