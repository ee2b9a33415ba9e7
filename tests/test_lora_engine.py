"""LoRA adapters in the engine: peft parity, mixed batches, validation, unload, prefix cache, max_loras."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core import EngineConfig, LLMEngine, RequestError, SamplingParams
from engine_core.lora import LoraError, LoraInUseError
from tests.conftest import build_tiny_model
from tests.engine_helpers import all_blocks_free_after_each_test, random_prompts, run_staggered  # noqa: F401
from tests.lora_helpers import edit_config, make_adapter, merged_model, teacher_forced_argmax

NEW = 12


@pytest.fixture(scope="module")
def adapters(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all-modules": make_adapter(smollm_dir, root / "a1", seed=1, rank=8),
        # rank 4 on q and v only (peft's usual choice for Llama): the other projections stay unadapted
        "qv-only": make_adapter(smollm_dir, root / "a2", seed=2, rank=4, target_modules=["q_proj", "v_proj"]),
    }


def _engine(smollm_dir: Path, adapters: dict[str, Path], **overrides) -> LLMEngine:
    settings = dict(model=str(smollm_dir), dtype="float32", num_blocks=256, max_num_batched_tokens=64,
                    max_num_seqs=16, lora_adapters={n: str(p) for n, p in adapters.items()})
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


@pytest.fixture(scope="module")
def engine(smollm_dir: Path, adapters: dict[str, Path]) -> LLMEngine:
    return _engine(smollm_dir, adapters)


def _tokens(outputs) -> list[list[int]]:
    return [[o.token_id for o in r] for r in outputs]


def test_adapter_greedy_tokens_equal_peft_merged_model_under_teacher_forcing(
        engine: LLMEngine, smollm_dir: Path, adapters: dict[str, Path]) -> None:
    # base and both adapters interleaved, staggered, through chunked prefill (64-token budget)
    prompts = random_prompts(6, [9, 70, 23, 4, 41, 15], engine.model_args.vocab_size, seed=3)
    names = [None, "all-modules", "qv-only", "all-modules", "qv-only", None]
    params = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, adapter=n) for n in names]
    got = _tokens(run_staggered(engine, prompts, params, [0, 0, 1, 2, 4, 5]))
    from transformers import AutoModelForCausalLM

    references = {None: AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()}
    references.update({n: merged_model(smollm_dir, p) for n, p in adapters.items()})
    for i, (name, prompt, tokens) in enumerate(zip(names, prompts, got)):
        assert len(tokens) == NEW
        assert tokens == teacher_forced_argmax(references[name], prompt, tokens), f"request {i} ({name}) diverged"


def test_a_big_prefill_step_with_several_adapters_takes_one_pass_per_adapter_and_the_same_tokens(
        smollm_dir: Path, adapters: dict[str, Path]) -> None:
    from engine_core.lora.batch import BIG_STEP_ROWS

    engine = _engine(smollm_dir, adapters, max_num_batched_tokens=2048)
    prompts = random_prompts(3, [BIG_STEP_ROWS, 150, 40], engine.model_args.vocab_size, seed=4)
    names = ["all-modules", "qv-only", None]
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=6, ignore_eos=True, adapter=name))
    batch = engine.scheduler.schedule()
    prepared = engine.runner.prepare(batch)
    assert prepared.lora is not None and prepared.lora.segments is not None  # the whole prefill in one step
    results: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    for out in engine.postprocess(batch, *engine.runner.run(batch)):
        results[out.request_id].append(out.token_id)
    while engine.has_unfinished():  # the decodes: 2 adapted rows, through the kernel (or the mask)
        for out in engine.step():
            results[out.request_id].append(out.token_id)
    masked = _tokens(_engine(smollm_dir, adapters).generate(  # a 64-token budget: chunks under the threshold
        prompts, [SamplingParams(max_new_tokens=6, ignore_eos=True, adapter=n) for n in names]))
    assert [results[f"r{i}"] for i in range(3)] == masked


def test_base_and_two_adapters_sent_together_each_get_their_own_outputs(engine: LLMEngine) -> None:
    prompt = engine.tokenize("The capital of France is")
    names = [None, "all-modules", "qv-only"]
    alone = [_tokens(engine.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True, adapter=n)))[0]
             for n in names]
    assert len({tuple(t) for t in alone}) == 3, "each adapter should change the greedy output"
    together = _tokens(engine.generate([prompt] * 3, [SamplingParams(max_new_tokens=NEW, ignore_eos=True, adapter=n)
                                                      for n in names]))
    assert engine.last_step is not None and engine.last_step.num_seqs == 3  # one step held all three
    assert together == alone


def test_an_unknown_adapter_is_refused_before_the_request_exists(engine: LLMEngine) -> None:
    with pytest.raises(RequestError, match="no LoRA adapter named 'nope'"):
        engine.add_request("x", [1, 2, 3], SamplingParams(adapter="nope"))
    assert "x" not in engine.seqs


def test_bad_adapter_directories_are_refused_with_the_reason(
        engine: LLMEngine, smollm_dir: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    good = adapters["all-modules"]
    tiny = build_tiny_model(tmp_path / "tiny", smollm_dir)
    cases = {
        "missing": (tmp_path / "absent", "no such directory"),
        "no config": (tmp_path, "adapter_config.json: missing"),
        "rank": (make_adapter(smollm_dir, tmp_path / "r32", seed=5, rank=32), "rank 32 exceeds max_lora_rank 16"),
        "embeddings": (make_adapter(smollm_dir, tmp_path / "emb", seed=6, target_modules=["embed_tokens"]),
                       "embed_tokens"),
        "another base": (make_adapter(tiny, tmp_path / "tiny-lora", seed=7), "the base model needs"),
        "dora": (edit_config(good, tmp_path / "dora", use_dora=True), "use_dora"),
        "bias": (edit_config(good, tmp_path / "bias", bias="all"), "bias"),
        "wrong rank in config": (edit_config(good, tmp_path / "r4", r=4), "has shape"),
    }
    for case, (path, reason) in cases.items():
        with pytest.raises(LoraError, match=reason):
            engine.load_adapter(f"bad-{case}", str(path))
        assert f"bad-{case}" not in engine.loras.adapters, case


def test_unload_while_requests_are_in_flight_is_refused_until_they_finish(
        smollm_dir: Path, adapters: dict[str, Path]) -> None:
    engine = _engine(smollm_dir, {})
    engine.load_adapter("temp", str(adapters["qv-only"]))
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=4, ignore_eos=True, adapter="temp"))
    engine.step()
    with pytest.raises(LoraInUseError, match="in use by 1 request"):
        engine.unload_adapter("temp")
    while engine.has_unfinished():
        engine.step()
    engine.unload_adapter("temp")
    assert "temp" not in engine.loras.adapters
    with pytest.raises(RequestError, match="no LoRA adapter"):
        engine.add_request("again", [5, 6, 7], SamplingParams(adapter="temp"))
    with pytest.raises(LoraError, match="no adapter named 'temp'"):
        engine.unload_adapter("temp")


def test_prefix_cache_entries_are_keyed_by_adapter(smollm_dir: Path, adapters: dict[str, Path]) -> None:
    engine = _engine(smollm_dir, adapters, enable_prefix_caching=True)
    uncached = _engine(smollm_dir, adapters)
    prompt = random_prompts(1, [50], engine.model_args.vocab_size, seed=8)[0]

    def run(name: str | None) -> tuple[list[int], int]:
        out = engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True, adapter=name))[0]
        return [o.token_id for o in out], out[0].num_cached_tokens

    base, cached = run(None)
    assert cached == 0
    first, cached = run("all-modules")
    assert cached == 0, "KV computed by the base model must not serve an adapter"
    second, cached = run("all-modules")
    assert cached > 0 and second == first
    other, cached = run("qv-only")
    assert cached == 0
    want = _tokens(uncached.generate([prompt] * 2, [SamplingParams(max_new_tokens=6, ignore_eos=True, adapter=n)
                                                    for n in ("all-modules", "qv-only")]))
    assert [first, other] == want
    assert engine.block_manager.check_all_free()


def test_a_step_never_holds_more_than_max_loras_adapters(smollm_dir: Path, adapters: dict[str, Path]) -> None:
    engine = _engine(smollm_dir, adapters, max_loras=1)
    prompts = random_prompts(6, [10, 20], engine.model_args.vocab_size, seed=9)
    names = ["all-modules", "qv-only", None, "qv-only", "all-modules", None]
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=5, ignore_eos=True, adapter=name))
    results: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    mixed_with_base = False
    while engine.has_unfinished():
        batch = engine.scheduler.schedule()
        distinct = {s.lora.uid for s in batch.seqs if s.lora is not None}
        assert len(distinct) <= 1
        mixed_with_base |= bool(distinct) and any(s.lora is None for s in batch.seqs)
        for out in engine.postprocess(batch, *engine.runner.run(batch)):
            results[out.request_id].append(out.token_id)
    assert mixed_with_base, "base rows run beside the one adapter"
    reference = _engine(smollm_dir, adapters)
    want = _tokens(reference.generate(prompts, [SamplingParams(max_new_tokens=5, ignore_eos=True, adapter=n)
                                                for n in names]))
    assert [results[f"r{i}"] for i in range(len(prompts))] == want
    assert engine.block_manager.check_all_free()


def test_bf16_with_the_fused_layer_ops_applies_the_adapter(smollm_dir: Path, adapters: dict[str, Path]) -> None:
    engine = _engine(smollm_dir, adapters, dtype="bfloat16")
    fp32 = _engine(smollm_dir, adapters)
    prompts = random_prompts(4, [20, 40], engine.model_args.vocab_size, seed=2)
    params = [SamplingParams(max_new_tokens=4, ignore_eos=True, adapter=n)
              for n in ("all-modules", "qv-only", "all-modules", None)]
    bf16 = _tokens(engine.generate(prompts, params))
    want = _tokens(fp32.generate(prompts, params))
    assert sum(a[0] == b[0] for a, b in zip(bf16, want)) >= 3  # first tokens agree despite rounding
    assert engine.block_manager.check_all_free()
