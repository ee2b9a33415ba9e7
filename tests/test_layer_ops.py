"""The compiled fused layer ops (bf16 RMSNorm with the residual add, rotary embeddings) against the torch
ops they replace, and the bf16 model forward through each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_core.cpu.kernels import cpu_kernels
from engine_core.models.layers.layer_ops import FusedLayerOps, TorchLayerOps
from engine_core.models.layers.rotary import RotaryEmbedding


@pytest.fixture(scope="module")
def kernels():  # type: ignore[no-untyped-def]
    module = cpu_kernels()
    if module is None or not hasattr(module, "rms_norm"):
        pytest.skip("no fused layer ops here (no C++ compiler, or no AVX-512 BF16): the model uses torch ops")
    return module


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fused_add_rms_norm_matches_torch_to_the_last_bit_or_one_ulp(kernels, rows: int) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(rows)
    h = torch.randn(rows, 576, dtype=torch.bfloat16) * 3
    delta = torch.randn_like(h)
    weight = torch.randn(576, dtype=torch.bfloat16)
    fused_h = h.clone()
    got = kernels.rms_norm(fused_h, delta, weight, 1e-5)
    assert torch.equal(fused_h, h + delta)  # the residual add happens in place, rounded like h + delta
    for mine, theirs in ((got, F.rms_norm(h + delta, (576,), weight, 1e-5)),
                         (kernels.rms_norm(h, None, weight, 1e-5), F.rms_norm(h, (576,), weight, 1e-5))):
        # the sum of squares is added in another order, so a rare element rounds the other way
        torch.testing.assert_close(mine, theirs, rtol=2 ** -7, atol=0)
        assert (mine != theirs).float().mean() < 1e-3


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fused_rotary_matches_torch_and_touches_only_queries_and_keys(kernels, head_dim: int) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(head_dim)
    heads, kv_heads, tokens = 6, 2, 41
    rope = RotaryEmbedding(head_dim, 2048, 10000.0, None, torch.bfloat16)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    positions = torch.randint(0, 2048, (tokens,))
    split = (heads + kv_heads) * head_dim
    torch_ops, fused = TorchLayerOps(1e-5), FusedLayerOps(1e-5, kernels, torch.bfloat16)
    torch_ops.begin_step(positions)
    fused.begin_step(positions)
    want = torch_ops.rotate(qkv[:, :split].view(tokens, -1, head_dim), rope).float()
    rotated = qkv.clone()
    fused.rotate(rotated[:, :split].view(tokens, -1, head_dim), rope)  # a strided view, rotated in place
    got = rotated[:, :split].view(tokens, -1, head_dim).float()
    assert (got - want).abs().max() <= 2 * 2 ** -8 * want.abs().max()  # bf16 rounding, not a wrong angle
    assert torch.equal(rotated[:, split:], qkv[:, split:])  # values untouched
    with pytest.raises(RuntimeError, match="outside the rotary tables"):
        kernels.rotary_(rotated[:, :split].view(tokens, -1, head_dim), torch.full((tokens,), 2048), rope.cos, rope.sin)


@pytest.mark.parametrize("rows", [1, 9, 200])
def test_fused_silu_and_mul_matches_torch(kernels, rows: int) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, dtype=torch.bfloat16) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate.double()) * up.double()
    got, theirs = kernels.silu_and_mul(gate_up).double(), (F.silu(gate) * up).double()
    # one rounding where torch rounds twice: never further from the exact value than torch's, plus an ulp
    assert ((got - exact).abs() <= (theirs - exact).abs() + 2 ** -8 * exact.abs() + 1e-30).all()
    torch.testing.assert_close(got, theirs, rtol=2 ** -6, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 9, 200])
def test_fused_gelu_tanh_and_mul_matches_torch(kernels, rows: int) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 2048, dtype=torch.bfloat16) * 4
    gate_up[0, :6] = torch.tensor([-200.0, -90.0, -13.0, 13.0, 90.0, 200.0])  # past the exp's range either way
    gate, up = gate_up.chunk(2, dim=-1)
    g = gate.double()  # x·sigmoid(2u) = 0.5·x·(1 + tanh(u)), without tanh's cancellation for very negative x
    exact = g * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)) * up.double()
    got, theirs = kernels.gelu_tanh_and_mul(gate_up).double(), (F.gelu(gate, approximate="tanh") * up).double()
    assert ((got - exact).abs() <= (theirs - exact).abs() + 2 ** -8 * exact.abs() + 1e-30).all()
    torch.testing.assert_close(got, theirs, rtol=2 ** -6, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 300])
def test_fused_norm_with_gemmas_fp32_weight_computes_the_product_in_fp32(kernels, rows: int) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(rows)
    h = torch.randn(rows, 640, dtype=torch.bfloat16) * 3
    delta = torch.randn_like(h)
    weight = 1 + torch.randn(640) * 0.3  # (1 + w), kept in fp32
    fused_h = h.clone()
    got = kernels.rms_norm(fused_h, delta, weight, 1e-6)
    assert torch.equal(fused_h, h + delta)
    want = TorchLayerOps(1e-6).norm(h + delta, weight)  # transformers' Gemma RMSNorm: fp32 throughout, one cast
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)
    assert (got != want).float().mean() < 1e-3


def test_bf16_forward_with_fused_ops_matches_torch_ops(smollm_dir: Path, kernels) -> None:  # type: ignore[no-untyped-def]
    from engine_core import EngineConfig, LLMEngine
    from tests.engine_helpers import random_prompts, scheduled_decode_step

    engine = LLMEngine(EngineConfig(model=str(smollm_dir), dtype="bfloat16", num_blocks=64, max_num_seqs=4))
    assert isinstance(engine.model.ops, FusedLayerOps)
    prepared = scheduled_decode_step(engine, random_prompts(3, [20, 40], 49152, seed=7))
    model = engine.model

    def forward() -> torch.Tensor:
        # the step writes its new keys and values into the cache; both runs write the same slots
        return model.forward(prepared.input_ids, prepared.positions, prepared.meta).float()

    fused = forward()
    model.ops = TorchLayerOps(model.args.rms_norm_eps)
    reference = forward()
    cosine = F.cosine_similarity(fused, reference, dim=-1)
    assert cosine.min() > 0.999, cosine
    fused_logits = model.compute_logits(fused.bfloat16()).float()
    reference_logits = model.compute_logits(reference.bfloat16()).float()
    # random-token prompts give flat distributions with near ties, so: each token the fused forward would
    # pick is, by the reference's logits, the best or within a rounding step of it
    picked = reference_logits.gather(1, fused_logits.argmax(-1, keepdim=True)).squeeze(1)
    assert (picked >= reference_logits.max(-1).values - 0.25).all()
