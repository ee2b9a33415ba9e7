"""Engine behaviour on the embedded SmolLM2: finishing rules, stop strings, seeds, logprobs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine_core import EngineConfig, LLMEngine, RequestError, SamplingParams
from engine_core.text.detokenizer import IncrementalDetokenizer
from tests.engine_helpers import all_blocks_free_after_each_test, chat, random_prompts, run_staggered  # noqa: F401


@pytest.fixture(scope="module")
def engine(smollm_dir: Path) -> Iterator[LLMEngine]:
    engine = LLMEngine(EngineConfig(model=str(smollm_dir), dtype="float32", num_blocks=400, max_num_batched_tokens=256))
    yield engine


def text_of(outputs) -> str:
    return "".join(o.text for o in outputs)


def test_short_answer_finishes_on_eos(engine: LLMEngine) -> None:
    [out] = engine.generate([chat(engine, "What is the capital of France?")], SamplingParams(max_new_tokens=40))
    assert out[-1].finish_reason == "eos_token" and out[-1].token_id == 2 and out[-1].special
    assert "Paris" in text_of(out) and "<|im_end|>" not in text_of(out)
    assert out[-1].token_text == "<|im_end|>"


def test_ignore_eos_min_tokens_and_stop_token_ids(engine: LLMEngine) -> None:
    prompt = chat(engine, "Hi")
    [natural] = engine.generate([prompt], SamplingParams(max_new_tokens=60))
    n = len(natural)
    assert natural[-1].finish_reason == "eos_token" and n < 40
    [ignored] = engine.generate([prompt], SamplingParams(max_new_tokens=n + 5, ignore_eos=True))
    assert len(ignored) == n + 5 and ignored[-1].finish_reason == "length"
    [at_least] = engine.generate([prompt], SamplingParams(max_new_tokens=60, min_tokens=n + 3))
    assert len(at_least) >= n + 3 and 2 not in [o.token_id for o in at_least[: n + 2]]
    first = natural[0].token_id
    [stopped] = engine.generate([prompt], SamplingParams(max_new_tokens=60, stop_token_ids=[first]))
    assert len(stopped) == 1 and stopped[0].finish_reason == "eos_token"


def test_stop_string_across_token_boundaries_is_cut_and_never_partially_streamed(engine: LLMEngine) -> None:
    prompt = chat(engine, "Write a short poem about the sea.")
    [full] = engine.generate([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True))
    # a stop string that starts in the middle of one token and ends inside a later one
    tokens = [o.token_text for o in full]
    start = sum(len(t) for t in tokens[:5]) - 2
    text = "".join(tokens)
    stop = text[start:start + 6]
    assert len(tokens[4]) > 2
    [cut] = engine.generate([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True, stop=[stop, "zzzz-never"]))
    assert text_of(cut) == text[: text.index(stop)]
    assert cut[-1].finish_reason == "stop_sequence" and cut[-1].stop_string == stop
    # the stream is a concatenation, so it never held a stop character; the start was held back
    assert "".join(o.text for o in cut[:5]) == text[:start]


def test_multibyte_text_is_never_split() -> None:
    from transformers import AutoTokenizer

    from engine_core.loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("embedded"))
    text = "Café 世界 🎉🚀 naïve — ½ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # several characters take more than one token
    detok = IncrementalDetokenizer(tok, [1], [], True, frozenset(tok.all_special_ids))
    pieces = [detok.step(t).text for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text
    assert "" in pieces  # some tokens carried half a character and released nothing


def test_stop_string_holdback_releases_text_when_the_match_fails() -> None:
    from transformers import AutoTokenizer

    from engine_core.loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("embedded"))
    ids = tok.encode("The end is near, the end.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], ["end."], True, frozenset())
    steps = [detok.step(t) for t in ids]
    assert "".join(s.text for s in steps) == "The end is near, the "
    assert steps[-1].stop_string == "end."


def test_seeded_sampling_is_identical_alone_and_in_a_busy_batch(engine: LLMEngine) -> None:
    prompt = engine.tokenize(chat(engine, "Tell me a story about a dragon."))
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_new_tokens=24, ignore_eos=True)
    [alone] = engine.generate([prompt], seeded)
    others = random_prompts(6, [10, 50, 80], 49152, seed=5)
    params = [SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True), SamplingParams(max_new_tokens=20)]
    busy = run_staggered(engine, others[:3] + [prompt] + others[3:],
                         [params[i % 2] for i in range(3)] + [seeded] + [params[i % 2] for i in range(3)],
                         [0, 0, 1, 2, 2, 3, 4])
    assert [o.token_id for o in busy[3]] == [o.token_id for o in alone]
    assert alone[0].seed == 1234
    [other_seed] = engine.generate([prompt], SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_new_tokens=24,
                                                            ignore_eos=True))
    assert [o.token_id for o in other_seed] != [o.token_id for o in alone]


def test_logprobs_and_prompt_logprobs_match_a_full_forward_log_softmax(engine: LLMEngine, smollm_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = engine.tokenize(chat(engine, "Name three colors."))
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2,
                                                     prompt_logprobs=True))
    ids = prompt + [o.token_id for o in out]
    model = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32)
    with torch.inference_mode():
        logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    plp = out[0].prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) - 1
    for pos, entry in enumerate(plp):
        assert entry.token_id == prompt[pos + 1]
        assert entry.logprob == pytest.approx(float(logp[pos, prompt[pos + 1]]), abs=2e-3)
    for i, o in enumerate(out):
        row = logp[len(prompt) - 1 + i]
        assert o.logprob == pytest.approx(float(row[o.token_id]), abs=2e-3)
        assert [t.token_id for t in o.top_logprobs] == row.topk(2).indices.tolist()


def test_requests_that_cannot_run_are_refused_with_a_reason(engine: LLMEngine) -> None:
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("e1", [], SamplingParams())
    with pytest.raises(RequestError, match="top_p"):
        engine.add_request("e2", [1, 2], SamplingParams(top_p=0.0))
    with pytest.raises(RequestError, match="KV cache"):
        engine.add_request("e3", [1, 2], SamplingParams(max_new_tokens=400 * 16))


def test_abort_frees_blocks_at_once(engine: LLMEngine) -> None:
    engine.add_request("a1", random_prompts(1, [100], 49152)[0], SamplingParams(max_new_tokens=50))
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.abort("a1") and not engine.abort("a1")
    assert engine.block_manager.check_all_free()


def test_prefix_caching_reuses_blocks_and_keeps_outputs(smollm_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(smollm_dir), dtype="float32", num_blocks=200, enable_prefix_caching=True))
    shared = random_prompts(1, [70], 49152, seed=9)[0]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    [first] = engine.generate([shared + [5, 6]], params)
    [second] = engine.generate([shared + [5, 6]], params)
    assert second[0].num_cached_tokens == 64 and first[0].num_cached_tokens == 0
    assert [o.token_id for o in first] == [o.token_id for o in second]
    assert engine.block_manager.prefix_hits >= 4 and engine.block_manager.check_all_free()
