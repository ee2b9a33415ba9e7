"""Every family the engine serves against transformers in fp32, on tiny random-weight checkpoints with the
family's special fields on: teacher-forced prompt logprobs of prompts of different lengths, and greedy
generations token for token, through paged attention with chunked prefill, prefix caching on, and prompts
longer than the sliding window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine_core import EngineConfig, LLMEngine, SamplingParams
from engine_core.models.args import ModelLoadError
from engine_core.models.registry import load_model_args
from tests.engine_helpers import hf_greedy, random_prompts, run_staggered
from tests.family_models import FAMILIES, WINDOW, build_family_model

LOGPROB_TOLERANCE = 2e-3  # max |Δ logprob| against transformers in fp32 (summation order only)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request: pytest.FixtureRequest, smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family_model(request.param, tmp_path_factory.mktemp(request.param), smollm_dir)


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    settings = dict(model=str(model_dir), dtype="float32", block_size=16, num_blocks=128, max_num_seqs=8,
                    max_num_batched_tokens=32, enable_prefix_caching=True)  # 32: long prompts prefill in chunks
    return LLMEngine(EngineConfig(**{**settings, **overrides}))


def _prompts(model_dir: Path) -> list[list[int]]:
    # all but the first longer than the window; Phi's longrope takes its long factors for the whole deployment
    # (max_model_len > original_max_position_embeddings, as vLLM does) and transformers only past 64 tokens
    short = 66 if "phi3" in model_dir.name else 9
    prompts = random_prompts(3, [short, 70, 130], 49152, seed=3)
    return prompts + [prompts[2][:96] + prompts[0]]  # shares 96 tokens (6 blocks) with the third: a cache hit


def _hf_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


def test_prompt_logprobs_match_transformers(family_dir: Path) -> None:
    engine = _engine(family_dir, enable_prefix_caching=False)  # every prompt token scored by this engine
    for i, prompt in enumerate(_prompts(family_dir)[:3]):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_new_tokens=1, prompt_logprobs=True))
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        got = torch.tensor([t.logprob for t in outputs[0].prompt_logprobs])
        want = _hf_logprobs(family_dir, prompt)
        assert (got - want).abs().max() < LOGPROB_TOLERANCE, f"prompt of {len(prompt)} tokens"
    assert engine.block_manager.check_all_free()


def test_greedy_generation_matches_transformers(family_dir: Path) -> None:
    engine = _engine(family_dir)
    prompts = _prompts(family_dir)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in prompts]
    outputs = run_staggered(engine, prompts, params, [0, 0, 1, 12])  # the last arrives after the third's prefill
    expected = hf_greedy(family_dir, prompts, 12)
    for i, (got, want) in enumerate(zip(outputs, expected)):
        assert [o.token_id for o in got] == want, f"prompt {i} ({len(prompts[i])} tokens) diverged"
    assert outputs[3][0].num_cached_tokens >= 80  # served partly from the prefix cache
    assert engine.block_manager.check_all_free()


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gemma3"])
def test_preemption_under_a_small_kv_budget_keeps_sliding_window_outputs(family: str, smollm_dir: Path,
                                                                          tmp_path: Path) -> None:
    # 14 blocks of 16 for prompts needing 1 + 6 + 9 + 7 blocks as they grow: requests are preempted and recomputed
    model_dir = build_family_model(family, tmp_path, smollm_dir)
    prompts = _prompts(model_dir)
    engine = _engine(model_dir, num_blocks=14)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in prompts]
    outputs = run_staggered(engine, prompts, params, [0, 0, 1, 2])
    assert engine.scheduler.num_preemptions > 0
    for i, (got, want) in enumerate(zip(outputs, hf_greedy(model_dir, prompts, 12))):
        assert [o.token_id for o in got] == want, f"prompt {i} ({len(prompts[i])} tokens) diverged"
    assert engine.block_manager.check_all_free()


def test_longrope_takes_its_short_factors_when_the_deployment_stays_within_the_original_length(
        smollm_dir: Path, tmp_path: Path) -> None:
    model_dir = build_family_model("phi3", tmp_path, smollm_dir)
    prompt = random_prompts(1, [40], 49152, seed=4)[0]
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=True)
    short = _engine(model_dir, max_model_len=64, enable_prefix_caching=False).generate([prompt], params)[0][0]
    got = torch.tensor([t.logprob for t in short.prompt_logprobs])
    assert (got - _hf_logprobs(model_dir, prompt)).abs().max() < LOGPROB_TOLERANCE


def test_sliding_window_changes_the_output(smollm_dir: Path, tmp_path: Path) -> None:
    """A window shorter than the prompt is honoured: without it (the same weights) the logprobs differ."""
    windowed = build_family_model("mistral", tmp_path / "windowed", smollm_dir)
    full = build_family_model("mistral", tmp_path / "full", smollm_dir, sliding_window=None)
    assert load_model_args(windowed).layer_windows == (WINDOW, WINDOW)
    prompt = random_prompts(1, [80], 49152, seed=5)[0]
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=True)
    got = [[t.logprob for t in _engine(d).generate([prompt], params)[0][0].prompt_logprobs] for d in (windowed, full)]
    assert got[0][:WINDOW - 1] == pytest.approx(got[1][:WINDOW - 1], abs=1e-4)  # within the window: the same
    assert max(abs(a - b) for a, b in zip(got[0][WINDOW:], got[1][WINDOW:])) > 1e-2


@pytest.mark.parametrize(("family", "change", "named"), [
    ("llama3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "type 'yarn'"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("qwen3", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
])
def test_unsupported_fields_are_refused_with_their_name(family: str, change: dict, named: str, smollm_dir: Path,
                                                        tmp_path: Path) -> None:
    model_dir = build_family_model(family, tmp_path, smollm_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelLoadError, match=named):
        _engine(model_dir)


def test_a_weight_the_family_does_not_use_is_refused(smollm_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = build_family_model("qwen3", tmp_path, smollm_dir)
    state = load_file(model_dir / "model.safetensors")
    state["model.layers.0.self_attn.extra_norm.weight"] = torch.ones(16)
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="does not use: model.layers.0.self_attn.extra_norm.weight"):
        _engine(model_dir)
