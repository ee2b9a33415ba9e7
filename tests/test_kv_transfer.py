"""A prompt's KV handed from one engine to another (prefill/decode disaggregation, engine_core/kv/transfer.py):
the decode engine goes on exactly as colocated serving would, and no block or file is left behind."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest

from engine_core import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from engine_core.kv.transfer import KvExport, KvHandle, transfer_path

PROMPTS = [
    "The capital of France is",
    "Write a list of the planets of the solar system with one fact about each:\n" + "Mercury is the closest. " * 20,
]


@pytest.fixture(scope="module")
def engines(smollm_dir: Path) -> tuple[LLMEngine, LLMEngine]:
    """A prefill engine and a decode engine, as two workers would have (fp32: equal greedy output)."""
    def make() -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(smollm_dir), dtype="float32", num_blocks=96,
                                      max_num_batched_tokens=64))
    return make(), make()


def run(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def prefill(engine: LLMEngine, prompt: str, params: SamplingParams,
            inline: bool = False) -> tuple[RequestOutput, str]:
    transfer_id = uuid.uuid4().hex
    engine.add_request("p", prompt, params, KvExport(transfer_id, inline))
    (first,) = run(engine)["p"]
    return first, transfer_id


def handed_over(engines: tuple[LLMEngine, LLMEngine], prompt: str, params: SamplingParams,
                inline: bool = False) -> list[RequestOutput]:
    prefiller, decoder = engines
    first, transfer_id = prefill(prefiller, prompt, params, inline)
    if first.finish_reason is not None:
        return [first]
    assert transfer_path(transfer_id).exists() != inline  # shm: a file; inline: the bytes in the handle
    assert first.kv_handle is not None and first.kv_error is None
    assert not prefiller.block_manager.check_all_free()  # parked: blocks held until released
    decoder.add_request("d", prompt, params, first.kv_handle)
    rest = run(decoder)["d"]
    assert prefiller.release_kv(transfer_id)
    assert prefiller.block_manager.check_all_free() and decoder.block_manager.check_all_free()
    assert not transfer_path(transfer_id).exists()
    return [first, *rest]


@pytest.mark.parametrize("inline", [False, True], ids=["shm", "inline"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "chunked"])
def test_handed_over_greedy_output_equals_colocated(engines, prompt, inline):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    (colocated,) = engines[1].generate([prompt], params)
    outputs = handed_over(engines, prompt, params, inline)
    assert [o.token_id for o in outputs] == [o.token_id for o in colocated]
    assert "".join(o.text for o in outputs) == "".join(o.text for o in colocated)
    assert outputs[1].kv_imported is not None and outputs[1].kv_imported.imported
    assert outputs[1].kv_imported.num_bytes == outputs[0].kv_handle.num_bytes > 0
    last = outputs[-1]
    assert (last.finish_reason, last.num_prompt_tokens, last.num_output_tokens) == \
        (colocated[-1].finish_reason, colocated[-1].num_prompt_tokens, colocated[-1].num_output_tokens)


def test_handed_over_seeded_sampling_equals_colocated(engines):
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    (colocated,) = engines[1].generate([PROMPTS[0]], params)
    outputs = handed_over(engines, PROMPTS[0], params)
    assert [o.token_id for o in outputs] == [o.token_id for o in colocated]


def test_stop_string_across_the_handover_is_held_back_and_cut(engines):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    (colocated,) = engines[1].generate([PROMPTS[0]], params)
    text = "".join(o.text for o in colocated)
    stop = text[1:8]  # starts within the first token's text and ends after it
    params = dataclasses.replace(params, stop=[stop])
    (colocated,) = engines[1].generate([PROMPTS[0]], params)
    outputs = handed_over(engines, PROMPTS[0], params)
    assert "".join(o.text for o in outputs) == "".join(o.text for o in colocated)
    assert outputs[-1].finish_reason == colocated[-1].finish_reason == "stop_sequence"


def test_a_request_that_ends_at_its_first_token_is_not_handed_over(engines):
    first, transfer_id = prefill(engines[0], PROMPTS[0], SamplingParams(max_new_tokens=1))
    assert first.finish_reason == "length" and first.kv_handle is None
    assert engines[0].block_manager.check_all_free() and not engines[0].parked
    assert not transfer_path(transfer_id).exists()


def test_missing_or_mismatched_kv_is_prefilled_locally_with_the_same_output(engines):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    (colocated,) = engines[1].generate([PROMPTS[1]], params)
    prefiller, decoder = engines
    for spoil in ("missing", "layout"):
        first, transfer_id = prefill(prefiller, PROMPTS[1], params)
        handle: KvHandle = first.kv_handle
        if spoil == "missing":
            transfer_path(transfer_id).unlink()
        else:
            handle = dataclasses.replace(handle, layout=dataclasses.replace(handle.layout, head_dim=32))
        decoder.add_request("d", PROMPTS[1], params, handle)
        rest = run(decoder)["d"]
        assert not rest[0].kv_imported.imported and rest[0].kv_imported.reason
        assert [o.token_id for o in [first, *rest]] == [o.token_id for o in colocated]
        prefiller.release_kv(transfer_id)
        assert prefiller.block_manager.check_all_free() and decoder.block_manager.check_all_free()


def test_an_unreleased_handover_frees_its_blocks_after_the_timeout(engines, monkeypatch):
    import engine_core.kv.handover as engine_module

    prefiller = engines[0]
    first, transfer_id = prefill(prefiller, PROMPTS[0], SamplingParams(max_new_tokens=8))
    assert transfer_id in prefiller.parked
    monkeypatch.setattr(engine_module, "PARKED_SECONDS", 0.0)
    prefiller.has_unfinished()
    assert not prefiller.parked and prefiller.block_manager.check_all_free()
    assert not transfer_path(transfer_id).exists()
