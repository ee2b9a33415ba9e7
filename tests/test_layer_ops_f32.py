"""The compiled fp32 fused layer ops (the forward `dtype = "auto"` serves on AVX2-only CPUs) against the
torch ops they replace, for both kinds of build, and the fp32 model forward through them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_core.models.layers.layer_ops import FusedLayerOps, TorchLayerOps
from engine_core.models.layers.rotary import RotaryEmbedding
from tests.kernel_helpers import ISAS, kernels_for


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fp32_add_rms_norm_matches_torch(isa: str, rows: int) -> None:
    kernels = kernels_for(isa)
    torch.manual_seed(rows)
    h = torch.randn(rows, 576) * 3
    delta = torch.randn_like(h)
    weight = torch.randn(576)
    fused_h = h.clone()
    got = kernels.rms_norm_f32(fused_h, delta, weight, 1e-5)
    assert torch.equal(fused_h, h + delta)  # the residual add happens in place
    torch.testing.assert_close(got, F.rms_norm(h + delta, (576,), weight, 1e-5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kernels.rms_norm_f32(h, None, weight, 1e-5), F.rms_norm(h, (576,), weight, 1e-5),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp32_rotary_matches_torch_and_touches_only_queries_and_keys(isa: str, head_dim: int) -> None:
    kernels = kernels_for(isa)
    torch.manual_seed(head_dim)
    heads, kv_heads, tokens = 6, 2, 41
    rope = RotaryEmbedding(head_dim, 2048, 10000.0, None, torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    positions = torch.randint(0, 2048, (tokens,))
    split = (heads + kv_heads) * head_dim
    torch_ops, fused = TorchLayerOps(1e-5), FusedLayerOps(1e-5, kernels, torch.float32)
    torch_ops.begin_step(positions)
    fused.begin_step(positions)
    want = torch_ops.rotate(qkv[:, :split].view(tokens, -1, head_dim), rope)
    rotated = qkv.clone()
    fused.rotate(rotated[:, :split].view(tokens, -1, head_dim), rope)  # a strided view, rotated in place
    torch.testing.assert_close(rotated[:, :split].view(tokens, -1, head_dim), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(rotated[:, split:], qkv[:, split:])  # values untouched
    with pytest.raises(RuntimeError, match="outside the rotary tables"):
        kernels.rotary_f32_(rotated[:, :split].view(tokens, -1, head_dim), torch.full((tokens,), 2048), rope.cos,
                            rope.sin)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 9, 200])
def test_fp32_silu_and_gelu_tanh_and_mul_match_torch(isa: str, rows: int) -> None:
    kernels = kernels_for(isa)
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536) * 4
    gate_up[0, :9] = torch.tensor([-200.0, -90.0, -30.0, -13.0, 0.0, 30.0, 90.0, 200.0, 1e-8])  # the exp's clamps
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul_f32(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    g = gate.double()  # x·sigmoid(2u) = 0.5·x·(1 + tanh(u)), without tanh's cancellation for very negative x
    gelu = g * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3))
    torch.testing.assert_close(kernels.gelu_tanh_and_mul_f32(gate_up).double(), gelu * up.double(),
                               rtol=1e-5, atol=1e-6)


def test_fp32_model_uses_the_fused_ops_and_keeps_the_greedy_tokens(smollm_dir: Path) -> None:
    """The fp32 forward through the fused ops picks the same greedy token as through torch ops."""
    from engine_core import EngineConfig, LLMEngine
    from tests.engine_helpers import random_prompts, scheduled_decode_step

    engine = LLMEngine(EngineConfig(model=str(smollm_dir), dtype="float32", num_blocks=64, max_num_seqs=4))
    if not isinstance(engine.model.ops, FusedLayerOps):
        pytest.skip("no compiled kernels here (no C++ compiler): the model uses torch ops")
    prepared = scheduled_decode_step(engine, random_prompts(3, [20, 40], 49152, seed=7))
    model = engine.model

    def logits() -> torch.Tensor:  # both runs write the same cache slots
        return model.compute_logits(model.forward(prepared.input_ids, prepared.positions, prepared.meta))

    fused = logits()
    model.ops = TorchLayerOps(model.args.rms_norm_eps)
    reference = logits()
    torch.testing.assert_close(fused, reference, rtol=1e-3, atol=1e-3)
    assert torch.equal(fused.argmax(-1), reference.argmax(-1))
