"""Greedy decoding through the paged KV cache matches transformers' own generate, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_core import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import build_tiny_model
from tests.engine_helpers import hf_greedy, random_prompts, run_staggered, scheduled_decode_step

LENGTHS = [5, 17, 33, 1, 64, 12, 100, 40]
ARRIVALS = [0, 0, 1, 2, 3, 5, 8, 9]


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    settings = dict(model=str(model_dir), dtype="float32", block_size=16, num_blocks=256,
                    max_num_batched_tokens=64, max_num_seqs=16)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def _check_against_hf(model_dir: Path, max_new: int, **engine_overrides) -> LLMEngine:
    engine = _engine(model_dir, **engine_overrides)
    prompts = random_prompts(8, LENGTHS, engine.model_args.vocab_size)
    params = [SamplingParams(max_new_tokens=max_new, ignore_eos=True) for _ in prompts]
    outputs = run_staggered(engine, prompts, params, ARRIVALS)
    expected = hf_greedy(model_dir, prompts, max_new)
    for i, (got, want) in enumerate(zip(outputs, expected)):
        assert [o.token_id for o in got] == want, f"prompt {i} ({len(prompts[i])} tokens) diverged"
        assert got[-1].finish_reason == "length" and all(o.finish_reason is None for o in got[:-1])
    assert engine.block_manager.check_all_free()
    return engine


def test_tiny_llama_greedy_matches_transformers_with_staggered_arrivals(tiny_llama_dir: Path) -> None:
    # a 64-token budget forces chunked prefill of the 100-token prompt while others decode
    _check_against_hf(tiny_llama_dir, max_new=24)


def test_smollm2_greedy_matches_transformers_with_staggered_arrivals(smollm_dir: Path) -> None:
    _check_against_hf(smollm_dir, max_new=16, max_num_batched_tokens=128)


@pytest.mark.parametrize("variant", ["llama3_rope", "qwen2_bias"])
def test_llama_family_variants_match_transformers(variant: str, smollm_dir: Path, tmp_path: Path) -> None:
    if variant == "llama3_rope":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        model_dir = build_tiny_model(tmp_path, smollm_dir, rope_parameters=rope)
    else:
        model_dir = build_tiny_model(tmp_path, smollm_dir, architecture="qwen2")
    _check_against_hf(model_dir, max_new=12)


def test_preemption_under_a_small_kv_budget_gives_the_same_outputs(tiny_llama_dir: Path) -> None:
    prompts = random_prompts(8, LENGTHS, 49152, seed=1)
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True) for _ in prompts]
    large = _engine(tiny_llama_dir, num_blocks=256)
    small = _engine(tiny_llama_dir, num_blocks=12)  # 192 token slots for ~600 needed at once
    want = run_staggered(large, prompts, params, ARRIVALS)
    got = run_staggered(small, prompts, params, ARRIVALS)
    assert small.scheduler.num_preemptions > 0
    assert [[o.token_id for o in r] for r in got] == [[o.token_id for o in r] for r in want]
    assert small.block_manager.check_all_free() and large.block_manager.check_all_free()


def test_bf16_engine_runs_and_mostly_agrees_with_fp32(smollm_dir: Path) -> None:
    prompts = random_prompts(4, [20, 40], 49152, seed=2)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    fp32 = [[o.token_id for o in r] for r in _engine(smollm_dir).generate(prompts, params)]
    bf16 = [[o.token_id for o in r] for r in _engine(smollm_dir, dtype="bfloat16").generate(prompts, params)]
    assert all(len(r) == 8 for r in bf16)
    assert sum(a[0] == b[0] for a, b in zip(fp32, bf16)) >= 3  # first tokens agree despite rounding


def test_bf16_decode_with_the_cpu_kernel_matches_the_torch_reference(smollm_dir: Path) -> None:
    """The same decode step through the compiled paged-decode kernel and through the reference."""
    import torch

    from engine_core.attention import TorchReferenceAttention
    from engine_core.attention.cpu_paged import CpuPagedAttention

    engine = _engine(smollm_dir, dtype="bfloat16")
    if not isinstance(engine.model.attention, CpuPagedAttention):
        pytest.skip("no C++ compiler here: bf16 uses the torch reference")
    # prefills, then decodes with contexts over several blocks
    prepared = scheduled_decode_step(engine, random_prompts(6, [20, 70], 49152, seed=4), warm_steps=12)
    kernel_attention = engine.model.attention
    hidden = engine.model.forward(prepared.input_ids, prepared.positions, prepared.meta)
    engine.model.attention = TorchReferenceAttention()
    reference = engine.model.forward(prepared.input_ids, prepared.positions, prepared.meta)
    engine.model.attention = kernel_attention
    cosine = torch.nn.functional.cosine_similarity(hidden.float(), reference.float(), dim=-1)
    assert cosine.min() > 0.999, cosine
    logits = engine.model.compute_logits
    assert torch.equal(logits(hidden).argmax(-1), logits(reference).argmax(-1))
