"""The compiled bf16 linear layer (`linear_bf16`, AVX-512 BF16 builds) against an fp32 reference, over the
shapes it meets (decode rows, prefill rows, column and row tails, a bias), and the engine's bf16 forward
with it against the same forward on oneDNN."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core.cpu.features import CpuFeatures, cpu_features
from engine_core.models.layers.linear import QUANT_KERNEL_MAX_ROWS, ROUNDED_MIN_ROWS, Linear, pack_blocks
from tests.kernel_helpers import assert_only_a_batch_step_takes, assert_rows_get_their_one_row_sums, kernels_for


@pytest.fixture(scope="module")
def kernels():  # type: ignore[no-untyped-def]
    return kernels_for("avx512_bf16")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ weight.float().t()
    return out + bias.float() if bias is not None else out


@pytest.mark.parametrize(("rows", "fan_in", "outs", "with_bias"), [
    (1, 576, 960, False),  # a decode row through the fused q/k/v
    (3, 1536, 576, True),  # a few decode rows, a bias
    (8, 576, 3072, False),  # a full block of rows
    (13, 576, 600, True),  # more rows than a block (a tail of 5), columns not a multiple of 16
    (17, 64, 48, False),  # prefill path: pairs of column blocks, an odd number of blocks
    (77, 576, 40, True),  # prefill path with a row tail and a column tail inside the last block
    (300, 100, 960, False),  # a prefill chunk
])
def test_linear_bf16_matches_an_fp32_reference(kernels, rows: int, fan_in: int, outs: int,  # type: ignore[no-untyped-def]
                                               with_bias: bool) -> None:
    torch.manual_seed(rows)
    weight = (torch.randn(outs, fan_in) * 0.05).bfloat16()
    bias = torch.randn(outs).bfloat16() if with_bias else None
    x = torch.randn(rows, fan_in).bfloat16()
    got = kernels.linear_bf16(x, pack_blocks(weight), outs, bias)
    want = reference(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, outs)
    # fp32 accumulation, one rounding to bf16 at the end: within bf16's half-ulp of the exact result
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-3)


def test_a_row_gets_the_same_sums_in_every_decode_sized_step(kernels) -> None:  # type: ignore[no-untyped-def]
    """Steps of 1 to 16 rows (decode, and a speculative verify pass of 1 + k rows) give each row the sums it gets
    alone, to the bit: greedy output must not move when drafts add rows to a step. (AMX runs such steps on its
    tiles, but the layers then use oneDNN, not this kernel.)"""
    if cpu_features().amx_bf16:
        pytest.skip("with AMX this kernel runs steps of 2 rows and more on the AMX tiles")
    torch.manual_seed(2)
    packed = pack_blocks((torch.randn(600, 576) * 0.05).bfloat16())
    assert_rows_get_their_one_row_sums(lambda rows: kernels.linear_bf16(rows, packed, 600, None, True),
                                       torch.randn(16, 576).bfloat16())


@pytest.mark.parametrize("rows", [ROUNDED_MIN_ROWS - 1, ROUNDED_MIN_ROWS, 13, QUANT_KERNEL_MAX_ROWS])
def test_a_step_without_a_verify_pass_takes_the_prefill_tiles_from_rounded_min_rows(kernels, rows: int) -> None:  # type: ignore[no-untyped-def]
    """A step that speculates nothing may run its 12-16-row bf16 matmuls on the prefill's tiles (two column blocks a
    broadcast, one sum a row: faster); its rows' sums then differ from the 1-row sums in the last bits, and a verify
    pass's rows keep them. The layer and the LM head (fp32 logits) follow one rule."""
    if cpu_features().amx_bf16:
        pytest.skip("with AMX this kernel runs steps of 2 rows and more on the AMX tiles")
    torch.manual_seed(rows)
    weight = (torch.randn(600, 576) * 0.05).bfloat16()
    x = torch.randn(rows, 576).bfloat16()
    for fp32_out in (False, True):
        layer = Linear(weight, None, kernels, fp32_out=fp32_out)
        batched = assert_only_a_batch_step_takes(
            lambda: kernels.linear_bf16(x, layer.blocks, 600, None, fp32_out, True), layer, x)  # noqa: B023
        torch.testing.assert_close(batched.float(), reference(x, weight, None), rtol=2 ** -8, atol=1e-3)


def test_linear_bf16_reads_rows_with_a_stride_and_refuses_mismatched_shapes(kernels) -> None:  # type: ignore[no-untyped-def]
    weight = (torch.randn(32, 64) * 0.1).bfloat16()
    wide = torch.randn(5, 80).bfloat16()
    x = wide[:, 8:72]  # rows 80 apart, 64 wide
    got = kernels.linear_bf16(x, pack_blocks(weight), 32, None)
    torch.testing.assert_close(got.float(), reference(x, weight, None), rtol=2 ** -8, atol=1e-3)
    with pytest.raises(RuntimeError, match="inputs"):
        kernels.linear_bf16(torch.randn(2, 66).bfloat16(), pack_blocks(weight), 32, None)
    with pytest.raises(RuntimeError, match="out_features"):
        kernels.linear_bf16(torch.randn(2, 64).bfloat16(), pack_blocks(weight), 48, None)
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.linear_bf16(torch.randn(2, 64), pack_blocks(weight), 32, None)


def test_a_linear_layer_takes_the_kernel_for_bf16_and_keeps_fp32_on_torch(kernels) -> None:  # type: ignore[no-untyped-def]
    weight = (torch.randn(40, 64) * 0.1).bfloat16()
    layer = Linear(weight, kernels=kernels)
    assert layer.blocks is not None and layer.weight is None  # the packed copy replaces the weight
    x = torch.randn(2, 3, 64).bfloat16()  # leading dimensions are kept
    torch.testing.assert_close(layer(x).float(), reference(x, weight, None), rtol=2 ** -8, atol=1e-3)
    assert Linear(weight.float(), kernels=kernels).blocks is None
    assert Linear(weight[:, :63].contiguous(), kernels=kernels).blocks is None  # an odd fan-in: oneDNN


def test_amx_is_read_from_the_flags_and_follows_the_isa_cap() -> None:
    amx = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16", "amx_tile"})
    assert CpuFeatures("sapphire rapids", amx, "avx512_bf16").amx_bf16
    assert not CpuFeatures("sapphire rapids, capped", amx, "avx512").amx_bf16
    assert not CpuFeatures("zen 4", amx - {"amx_bf16", "amx_tile"}, "avx512_bf16").amx_bf16


def test_an_amx_cpu_runs_the_engine_matmuls_on_onednn(smollm_dir: Path, kernels) -> None:  # type: ignore[no-untyped-def]
    """oneDNN's AMX GEMM beats linear_bf16's at prefill sizes there (docs/benchmarks.md): the engine packs for it."""
    from engine_core import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(smollm_dir), dtype="bfloat16", quantization="none", num_blocks=16,
                                    max_num_seqs=2))
    layers = [engine.model.layers[0].attn.qkv, engine.model.layers[-1].mlp.down]
    expected = "oneDNN packed" if cpu_features().amx_bf16 else "linear_bf16"
    assert [layer.path for layer in layers] == [expected] * 2
    # the LM head's fp32 logits: oneDNN has no bf16 matmul with an fp32 result in torch
    assert engine.model.lm_head.path == "linear_bf16"


def test_the_bf16_engine_forward_with_the_kernel_matches_onednn(smollm_dir: Path, kernels,  # type: ignore[no-untyped-def]
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_core import EngineConfig, LLMEngine
    from tests.engine_helpers import random_prompts, scheduled_decode_step

    monkeypatch.setattr("engine_core.models.layers.weights.linear_kernels", lambda k: k)  # the kernel, AMX or not
    engine = LLMEngine(EngineConfig(model=str(smollm_dir), dtype="bfloat16", quantization="none", num_blocks=64,
                                    max_num_seqs=4))
    model = engine.model
    assert model.layers[0].attn.qkv.blocks is not None and model.lm_head.blocks is not None
    prepared = scheduled_decode_step(engine, random_prompts(3, [20, 40], 49152, seed=11))
    hidden = model.forward(prepared.input_ids, prepared.positions, prepared.meta)
    logits = model.compute_logits(hidden).float()
    linears = [linear for lay in model.layers for linear in (lay.attn.qkv, lay.attn.o, lay.mlp.gate_up, lay.mlp.down)]
    for layer in [model.lm_head, *linears]:
        # back to oneDNN's packed weight, from the same bf16 values
        plain = layer.blocks.permute(0, 2, 1, 3).reshape(-1, layer.blocks.shape[1] * 2)[:layer.out_features]
        layer.blocks, layer.packed = None, torch.ops.mkldnn._reorder_linear_weight(plain.contiguous(), 1)
    reference_hidden = model.forward(prepared.input_ids, prepared.positions, prepared.meta)
    cosine = torch.nn.functional.cosine_similarity(hidden.float(), reference_hidden.float(), dim=-1)
    assert cosine.min() > 0.999, cosine
    reference_logits = model.compute_logits(reference_hidden).float()
    # near ties among random-token prompts: the kernel's pick is the reference's best or within a rounding step
    picked = reference_logits.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    assert (picked >= reference_logits.max(-1).values - 0.25).all()
