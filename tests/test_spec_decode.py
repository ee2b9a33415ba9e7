"""Speculative decoding in the engine: exact greedy and sampled output, KV accounting, and when it turns off.

Greedy identity is checked in fp32 on every CPU. In bf16 a row's sums must not depend on the rows its step
has, or a verify pass (1 + k rows) parts from a 1-row step at an ulp-level tie: that holds for decode-sized
steps on the AVX-512 BF16 kernels without AMX (with AMX, steps of more than 4 rows run on its tiles), and is
checked there one request at a time.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine_core import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from engine_core.cpu.features import cpu_features
from engine_core.spec_decode import SpeculativeConfig
from engine_core.structured import StructuredOutputsParams
from tests.conftest import build_tiny_model
from tests.engine_helpers import all_blocks_free_after_each_test, chat  # noqa: F401
from tests.lora_helpers import make_adapter

CODE = "\n".join(f"def area_{i}(width, height):\n    result = width * height + {i}\n    return result"
                 for i in range(8))
PROMPTS = [  # repeating (drafts accepted) and open-ended (few drafts, most rejected)
    f"Rename result to total in this code and print it all again:\n{CODE}\n\n{CODE[:60]}",
    "Count from 1 to 40: " + ", ".join(str(i) for i in range(1, 21)),
    "Write a short poem about the sea.",
]
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4,
                          disable_by_batch_size=None)
SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=5, disable_by_batch_size=None)


def engine_with(model: Path | str, spec: SpeculativeConfig | None, **overrides) -> LLMEngine:
    settings = dict(model=str(model), dtype="float32", num_blocks=600, speculative=spec)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [o.token_id for o in outputs]


@pytest.fixture(scope="module")
def plain(smollm_dir: Path) -> LLMEngine:
    return engine_with(smollm_dir, None)


@pytest.fixture(scope="module")
def engine(smollm_dir: Path) -> LLMEngine:
    return engine_with(smollm_dir, NGRAM, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def draft_dir(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight draft with SmolLM2's tokenizer: it shares the vocabulary, as a draft must."""
    return build_tiny_model(tmp_path_factory.mktemp("draft"), smollm_dir)


def test_greedy_output_is_token_for_token_the_output_without_speculation(plain: LLMEngine, engine: LLMEngine) -> None:
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    prompts = [chat(plain, p) for p in PROMPTS]
    before = engine.spec.counters.num_accepted_tokens  # type: ignore[union-attr]
    assert [tokens(o) for o in engine.generate(prompts, params)] == [tokens(o) for o in plain.generate(prompts, params)]
    assert engine.spec.counters.num_accepted_tokens - before > 20  # type: ignore[union-attr]  # it speculated


@pytest.mark.skipif(not cpu_features().native_bf16 or cpu_features().amx_bf16,
                    reason="a row's bf16 sums are the same in steps of 1-16 rows on the AVX-512 BF16 kernels, no AMX")
@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_bf16_greedy_output_one_request_at_a_time_is_the_output_without_speculation(smollm_dir: Path,
                                                                                     quantization: str) -> None:
    """The embedded model in bf16 on such a CPU, on its Q4_1 weights (the default) and on bf16 weights: a verify
    pass scores each position as the plain decode step does."""
    plain_bf16, spec_bf16 = (engine_with(smollm_dir, spec, dtype="bfloat16", quantization=quantization)
                             for spec in (None, SUFFIX))
    params = SamplingParams(max_new_tokens=96)
    more = ["Explain what a compiler does, step by step.",
            "List ten animals that live in the ocean and say one thing about each."]
    prompts = [chat(plain_bf16, p) for p in [*PROMPTS, *more]]
    for prompt in prompts:  # one at a time: every step is 1 row without drafts, 1 + k with them
        assert tokens(spec_bf16.generate([prompt], params)[0]) == tokens(plain_bf16.generate([prompt], params)[0])
    assert spec_bf16.spec.counters.num_accepted_tokens > 20  # type: ignore[union-attr]  # it speculated


@pytest.mark.parametrize("spec", [SUFFIX], ids=["suffix"])
def test_suffix_drafts_from_earlier_requests_keep_greedy_output(plain: LLMEngine, smollm_dir: Path,
                                                                spec: SpeculativeConfig) -> None:
    engine = engine_with(smollm_dir, spec)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompt = chat(plain, PROMPTS[0])
    first = tokens(engine.generate([prompt], params)[0])
    accepted = engine.spec.counters.num_accepted_tokens  # type: ignore[union-attr]
    second = tokens(engine.generate([prompt], params)[0])  # the same request again: its answer is indexed
    assert first == second == tokens(plain.generate([prompt], params)[0])
    gained = engine.spec.counters.num_accepted_tokens - accepted  # type: ignore[union-attr]
    assert gained >= 30 and gained > accepted
    assert engine.block_manager.check_all_free()


def test_stop_strings_max_tokens_and_logprobs_match_without_speculation(plain: LLMEngine, engine: LLMEngine) -> None:
    prompt = chat(plain, PROMPTS[1])
    reference = plain.generate([prompt], SamplingParams(max_new_tokens=60, ignore_eos=True))[0]
    text = "".join(o.text for o in reference)
    stop = text[len(text) // 2: len(text) // 2 + 4]
    for params in (SamplingParams(max_new_tokens=60, stop=[stop], logprobs=2),
                   SamplingParams(max_new_tokens=7, ignore_eos=True, logprobs=0)):
        with_spec, without = engine.generate([prompt], params)[0], plain.generate([prompt], params)[0]
        assert tokens(with_spec) == tokens(without)
        assert "".join(o.text for o in with_spec) == "".join(o.text for o in without)
        assert [o.finish_reason for o in with_spec] == [o.finish_reason for o in without]
        for a, b in zip(with_spec, without):  # every emitted token has its logprob, drafted or not
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]


def test_a_batch_mixes_speculating_and_plain_rows(plain: LLMEngine, engine: LLMEngine) -> None:
    prompts = [chat(plain, p) for p in PROMPTS[:2]] * 2
    params = [SamplingParams(max_new_tokens=32, ignore_eos=True, speculative=i % 2 == 0) for i in range(4)]
    out = engine.generate(prompts, params)
    assert [tokens(o) for o in out] == [tokens(o) for o in plain.generate(prompts, params)]


def test_lora_requests_speculate_with_their_adapter(plain: LLMEngine, smollm_dir: Path,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    adapter = make_adapter(smollm_dir, tmp_path_factory.mktemp("spec-lora") / "a", seed=5, rank=4)
    with_spec = engine_with(smollm_dir, NGRAM, lora_adapters={"a": str(adapter)})
    without = engine_with(smollm_dir, None, lora_adapters={"a": str(adapter)})
    prompts = [chat(plain, PROMPTS[1])] * 2
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True, adapter=name) for name in ("a", None)]
    out = with_spec.generate(prompts, params)
    assert [tokens(o) for o in out] == [tokens(o) for o in without.generate(prompts, params)]
    assert tokens(out[0]) != tokens(out[1])  # the adapter changes the answer it speculated on
    assert with_spec.spec.counters.num_accepted_tokens > 0  # type: ignore[union-attr]


def test_only_verified_tokens_enter_the_prefix_cache(plain: LLMEngine, smollm_dir: Path) -> None:
    engine = engine_with(smollm_dir, NGRAM, enable_prefix_caching=True)
    prompt = engine.tokenize(chat(plain, PROMPTS[0]))
    out = tokens(engine.generate([prompt], SamplingParams(max_new_tokens=64, ignore_eos=True))[0])
    assert engine.spec.counters.num_draft_tokens > engine.spec.counters.num_accepted_tokens  # type: ignore[union-attr]
    text, bs = prompt + out, engine.block_manager.block_size
    cached = {b.token_ids for b in engine.block_manager.blocks if b.block_hash is not None}
    assert cached and cached <= {tuple(text[i:i + bs]) for i in range(0, len(text) - bs + 1, bs)}
    again = SamplingParams(max_new_tokens=16, ignore_eos=True)
    assert tokens(engine.generate([text[:-8]], again)[0]) == tokens(plain.generate([text[:-8]], again)[0])
    assert engine.block_manager.prefix_hits > 0


def test_preemption_during_speculation_keeps_the_output(plain: LLMEngine, smollm_dir: Path) -> None:
    small = engine_with(smollm_dir, NGRAM, num_blocks=40, max_num_batched_tokens=256)
    prompts = [chat(plain, PROMPTS[1])] * 3
    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    out = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0
    assert [tokens(o) for o in out] == [tokens(o) for o in plain.generate(prompts, params)]
    assert small.block_manager.check_all_free()


def test_abort_with_drafts_in_flight_frees_every_block(plain: LLMEngine, engine: LLMEngine) -> None:
    engine.add_request("a", chat(plain, PROMPTS[1]), SamplingParams(max_new_tokens=200, ignore_eos=True))
    for _ in range(40):
        engine.step()
        if engine.seqs["a"].spec_token_ids:
            break
    assert engine.seqs["a"].spec_token_ids  # drafts are scheduled for the next step
    engine.step()  # a verify pass
    assert engine.abort("a")
    assert engine.block_manager.check_all_free() and not engine.has_unfinished()
    assert "a" not in engine.spec.acceptance  # type: ignore[union-attr]


def test_grammar_constrained_speculation_is_valid_json_and_equal(plain: LLMEngine, engine: LLMEngine) -> None:
    schema = {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"},
                                                           "maxItems": 12}}, "required": ["numbers"]}
    prompt = chat(plain, "Return JSON with the numbers 1, 2, 3, 4, 5, 6, 7, 8 in a list called numbers. "
                         '{"numbers": [1, 2, 3, 4, 5, 6, 7, 8]}')
    params = SamplingParams(max_new_tokens=80, structured_outputs=StructuredOutputsParams(json=schema))
    before = engine.spec.counters.num_accepted_tokens  # type: ignore[union-attr]
    out = engine.generate([prompt], params)[0]
    assert tokens(out) == tokens(plain.generate([prompt], params)[0])
    assert isinstance(json.loads("".join(o.text for o in out))["numbers"], list)
    assert engine.spec.counters.num_accepted_tokens > before  # type: ignore[union-attr]


def test_draft_model_keeps_greedy_output_and_low_acceptance_stops_drafting(plain: LLMEngine, smollm_dir: Path,
                                                                           draft_dir: Path) -> None:
    spec = SpeculativeConfig(method="draft_model", model=str(draft_dir), num_speculative_tokens=3,
                             disable_by_batch_size=None)
    engine = engine_with(smollm_dir, spec)
    prompts = [chat(plain, p) for p in PROMPTS[1:]]
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    assert [tokens(o) for o in engine.generate(prompts, params)] == [tokens(o) for o in plain.generate(prompts, params)]
    counters = engine.spec.counters  # type: ignore[union-attr]
    # random weights: next to nothing accepted, so each request drafts less and less often (back-off doubles)
    assert 0 < counters.num_drafts <= 2 * 12
    assert engine.block_manager.check_all_free()
    assert engine.spec.proposer.blocks.check_all_free()  # type: ignore[union-attr]


def test_draft_with_another_vocabulary_is_refused_at_start(smollm_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "other", smollm_dir, vocab_size=1000)
    with pytest.raises(ValueError, match="share the tokenizer"):
        engine_with(smollm_dir, SpeculativeConfig(method="draft_model", model=str(other)))


def test_no_drafts_from_disable_by_batch_size_running_requests(plain: LLMEngine, smollm_dir: Path) -> None:
    busy = engine_with(smollm_dir, SpeculativeConfig(method="ngram", prompt_lookup_min=2, disable_by_batch_size=2))
    busy.generate([chat(plain, PROMPTS[1])] * 3, SamplingParams(max_new_tokens=24, ignore_eos=True))
    drafts_when_busy = busy.spec.counters.num_drafts  # type: ignore[union-attr]
    busy.generate([chat(plain, PROMPTS[1])], SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert drafts_when_busy <= 2  # only once two of the three had finished
    assert busy.spec.counters.num_drafts > drafts_when_busy  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", [dict(method="eagle"), dict(method="ngram", num_speculative_tokens=0),
                                 dict(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2),
                                 dict(method="draft_model"), dict(method="ngram", model="x")])
def test_bad_speculative_configs_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SpeculativeConfig(**bad)


def test_lookup_defaults_follow_vllm() -> None:
    assert SpeculativeConfig(method="ngram").lookup_range() == (5, 5)
    assert SpeculativeConfig(method="ngram", prompt_lookup_max=3).lookup_range() == (3, 3)
    assert SpeculativeConfig(method="ngram", prompt_lookup_min=2, prompt_lookup_max=4).lookup_range() == (2, 4)


# the distribution of sampled output

SAMPLES = 600  # per arm; the lossy rule below moves ~40% of the mass, the exact rule nothing
SIGNIFICANCE = 0.001  # the chi-square test's level: equal distributions pass, a lossy rule fails


def chi_square_p_value(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """Two-sample chi-square test of equal distributions (rare categories pooled); its p-value."""
    total_a, total_b = sum(a.values()), sum(b.values())
    common, rare_a, rare_b = [], 0, 0
    for key in set(a) | set(b):
        if (a[key] + b[key]) * min(total_a, total_b) / (total_a + total_b) >= min_expected:
            common.append((a[key], b[key]))
        else:
            rare_a, rare_b = rare_a + a[key], rare_b + b[key]
    common.append((rare_a, rare_b))
    stat = 0.0
    for x, y in common:
        row = x + y
        for observed, total in ((x, total_a), (y, total_b)):
            expected = row * total / (total_a + total_b)
            if expected:
                stat += (observed - expected) ** 2 / expected
    df = len(common) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def bigram_dir(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights with attention's output zeroed: the next token depends on the last one only, so a
    prompt holding the model's likely successors gets drafts accepted about half the time; a sharpened
    LM head keeps the distribution to a few dozen likely 4-token outputs."""
    from safetensors.torch import load_file, save_file

    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-bigram"), smollm_dir, initializer_range=1.0)
    weights = load_file(model_dir / "model.safetensors")
    weights["lm_head.weight"] *= 2.0
    for name, tensor in weights.items():
        if name.endswith("self_attn.o_proj.weight"):
            tensor.zero_()
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


def first_tokens(engine: LLMEngine, prompt: list[int], seed0: int, **params) -> Counter:
    """The first four output tokens of SAMPLES seeded temperature-1 requests (positions 2-4 come from verify
    passes when speculating)."""
    out = engine.generate([prompt] * SAMPLES, [SamplingParams(temperature=1.0, seed=seed0 + i, max_new_tokens=4,
                                                              ignore_eos=True, **params) for i in range(SAMPLES)])
    return Counter(tuple(tokens(o)) for o in out)


@pytest.mark.parametrize("params", [{}, {"top_p": 0.8}], ids=["temperature-1", "top-p"])
def test_sampled_output_follows_the_distribution_without_speculation(bigram_dir: Path, params: dict,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    off = engine_with(bigram_dir, None, num_blocks=4000, max_num_seqs=SAMPLES)
    on = engine_with(bigram_dir, SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                                                 prompt_lookup_max=2, disable_by_batch_size=None,
                                                 min_accepted_tokens=0.0),
                     num_blocks=4000, max_num_seqs=SAMPLES)
    # the prompt repeats the model's own greedy continuation, so n-gram drafts are likely tokens
    seed_prompt = on.tokenize("The cat")
    greedy = tokens(off.generate([seed_prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0])
    prompt = (seed_prompt + greedy) * 3 + seed_prompt
    reference = first_tokens(off, prompt, 0, **params)
    speculated = first_tokens(on, prompt, 10**6, **params)  # independent seeds
    counters = on.spec.counters  # type: ignore[union-attr]
    assert counters.num_draft_tokens > SAMPLES and counters.num_accepted_tokens > SAMPLES // 4
    assert chi_square_p_value(reference, speculated) > SIGNIFICANCE

    def lossy(sampled: int, draft: int, logits: torch.Tensor) -> bool:  # "typical acceptance": near the top
        return sampled == draft or bool(logits[draft] >= logits.max() - 2.0)

    monkeypatch.setattr("engine_core.engine.draft_accepted", lossy)
    biased = first_tokens(on, prompt, 2 * 10**6, **params)
    assert chi_square_p_value(reference, biased) < SIGNIFICANCE
