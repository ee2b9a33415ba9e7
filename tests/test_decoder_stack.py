"""The compiled decoder stack (engine_core/models/layers/decoder_stack.py) against the Python layers it replaces:
the same step's hidden states to the bit, for every family and weight format it serves, in decode steps and in a
small prefill; and the models and steps it does not serve take the Python layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core import EngineConfig, LLMEngine, SamplingParams
from engine_core.cpu.kernels import cpu_kernels
from engine_core.models.layers.decoder_stack import stack_serves
from engine_core.models.layers.linear import ROUNDED_MIN_ROWS
from tests.engine_helpers import random_prompts, run_staggered
from tests.family_models import build_family_model

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ compiler for the CPU kernels")

# (model, quantization): the embedded GGUF (Q4_1 layers, a Q8_0 table), int8 and int4 made at load, plain fp32
# weights with a sliding window (Mistral), q/k biases and a window on some layers (Qwen2), per-head q/k norms (Qwen3)
CASES = [("embedded", "auto", "float32"), ("embedded", "int8", "float32"), ("mistral", "auto", "float32"),
         ("qwen2", "auto", "float32"), ("qwen2", "int4", "float32"), ("qwen3", "auto", "float32"),
         ("qwen3", "int8", "float32"),
         # bf16 activations (AVX-512 BF16 builds): the GGUF's own blocks, int8, bf16 weights packed for linear_bf16
         # (not the tiny Qwen2: its 16-wide heads are narrower than the bf16 layer kernels take)
         ("embedded", "auto", "bfloat16"), ("embedded", "int8", "bfloat16"), ("embedded", "none", "bfloat16"),
         ("qwen3", "int4", "bfloat16"), ("qwen3", "auto", "bfloat16")]
HAS_BF16_KERNELS = cpu_kernels() is not None and hasattr(cpu_kernels(), "linear_bf16")


def _model_dir(name: str, smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return smollm_dir if name == "embedded" else build_family_model(name, tmp_path_factory.mktemp(name), smollm_dir)


def _engine(model_dir: Path, quantization: str, dtype: str = "float32") -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, quantization=quantization, block_size=16,
                                  num_blocks=64, max_num_seqs=8, enable_prefix_caching=False))


@pytest.mark.parametrize(("name", "quantization", "dtype"), CASES, ids=["-".join(case) for case in CASES])
def test_the_compiled_stack_gives_the_python_layers_hidden_states_to_the_bit(
        name: str, quantization: str, dtype: str, smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every step of a staggered greedy run is computed both ways (the step's keys and values go to the same
    slots twice, with the same values): prefills of 9-41 tokens (longer than the tiny models' window of 24) on
    the Python layers, then decodes of up to four rows and a mixed step with a 13-token prefill on the stack."""
    if dtype == "bfloat16" and not HAS_BF16_KERNELS:
        pytest.skip("the bf16 layer kernels are in AVX-512 BF16 builds only")
    engine = _engine(_model_dir(name, smollm_dir, tmp_path_factory), quantization, dtype)
    model = engine.model
    stack, forward = model.stack, model.forward
    assert stack is not None
    on_stack: list[int] = []

    def both_ways(input_ids: torch.Tensor, positions: torch.Tensor, meta, lora=None, exact=True) -> torch.Tensor:
        compiled = forward(input_ids, positions, meta, lora, exact)
        model.stack = None
        try:
            python = forward(input_ids, positions, meta, lora, exact)
        finally:
            model.stack = stack
        assert torch.equal(compiled, python), (input_ids.numel(), (compiled - python).abs().max())
        if stack_serves(stack, input_ids.numel(), model.attention.plan(meta, 16), lora):
            on_stack.append(input_ids.numel())
        return compiled

    model.forward = both_ways  # type: ignore[method-assign]
    prompts = random_prompts(4, [9, 30, 41, 13], 49152, seed=5)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True) for _ in prompts]
    outputs = run_staggered(engine, prompts, params, arrive_at_step=[0, 0, 0, 4])
    assert all(len(out) == 12 for out in outputs)
    # the mixed step (16 rows: from ROUNDED_MIN_ROWS a step without drafts rounds), and four-row decodes
    assert max(on_stack) == 3 + 13 >= ROUNDED_MIN_ROWS and on_stack.count(4) >= 5, on_stack


@pytest.mark.parametrize("name", ["gemma3", "phi3", "qwen3_moe"])
def test_models_the_stack_does_not_run_keep_the_python_layers(
        name: str, smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Gemma's sandwich norms, Phi's partial rotary and the experts' MLP are not the stack's layer."""
    engine = _engine(_model_dir(name, smollm_dir, tmp_path_factory), "auto")
    assert engine.model.stack is None
    assert engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True))[0][-1].finish_reason


def test_a_bf16_model_runs_on_the_stack_only_where_the_build_has_the_bf16_kernels(smollm_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(smollm_dir), dtype="bfloat16", num_blocks=16))
    assert (engine.model.stack is not None) == HAS_BF16_KERNELS
