"""The step's token budget: a long prompt's chunks and the prompts that arrive behind it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_core import EngineConfig, LLMEngine, SamplingParams
from engine_core.kv.block_manager import BlockManager
from engine_core.sampling.params import SamplingParams as Params
from engine_core.scheduler import Scheduler
from engine_core.sequence import Sequence
from tests.engine_helpers import run_staggered


def _steps_until_short_starts(threshold: int) -> tuple[int, list[int]]:
    """Step a 400-token prompt with a 128-token budget; a 10-token prompt arrives after its first chunk. Returns
    the step in which the short prompt is first scheduled, and the long prompt's chunk sizes up to then."""
    bm = BlockManager(num_blocks=64, block_size=16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=128, long_prefill_token_threshold=threshold)
    long, short = Sequence("long", list(range(400)), Params()), Sequence("short", list(range(10)), Params())
    sched.add(long)
    chunks: list[int] = []
    for step in range(1, 10):
        batch = sched.schedule()
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new
            if seq is long:
                chunks.append(num_new)
        if short in batch.seqs:
            return step, chunks
        if step == 1:
            sched.add(short)
    raise AssertionError("the short prompt was never scheduled")


def test_a_short_prompt_waits_for_a_long_prefill_without_a_threshold() -> None:
    step, chunks = _steps_until_short_starts(threshold=0)
    assert chunks == [128, 128, 128, 16] and step == 4  # the long prompt takes the whole budget until its end


def test_long_prefill_token_threshold_starts_a_short_prompt_in_the_next_step() -> None:
    step, chunks = _steps_until_short_starts(threshold=64)
    assert step == 2 and chunks == [64, 64]  # the long prompt's chunks leave the budget's rest to the short one


def test_long_prefill_token_threshold_never_cuts_a_decode_or_its_drafts() -> None:
    bm = BlockManager(num_blocks=16, block_size=16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=128, long_prefill_token_threshold=4)
    seq = Sequence("decoding", list(range(20)), Params())
    sched.add(seq)
    while seq.num_computed_tokens < seq.num_tokens:
        batch = sched.schedule()
        assert batch.num_new_tokens == [4]
        seq.num_computed_tokens += 4
    seq.token_ids.append(1)
    seq.spec_token_ids = [2, 3, 4, 5, 6]  # the last token and five drafts: 6 tokens, over the cap of 4
    batch = sched.schedule()
    assert batch.num_new_tokens == [6] and batch.spec_token_ids == [[2, 3, 4, 5, 6]]


@pytest.mark.parametrize("threshold", [0, 24])
def test_greedy_output_is_the_same_with_capped_prefill_chunks(smollm_dir: Path, threshold: int) -> None:
    """Short prompts arrive while a 150-token one prefills in chunks; each answer is the one it gets alone."""
    prompts = [[(i * 37 + j * 11) % 4000 + 50 for j in range(length)] for i, length in enumerate([150, 9, 70, 3])]
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True)] * len(prompts)
    engine = LLMEngine(EngineConfig(model=str(smollm_dir), dtype="float32", num_blocks=96, max_num_seqs=8,
                                    max_num_batched_tokens=64, long_prefill_token_threshold=threshold))
    outputs = run_staggered(engine, prompts, params, [0, 1, 1, 2])
    reference = LLMEngine(EngineConfig(model=str(smollm_dir), dtype="float32", num_blocks=96,
                                       max_num_batched_tokens=512))
    for prompt, got in zip(prompts, outputs, strict=True):
        (want,) = reference.generate([prompt], params[0])
        assert [o.token_id for o in got] == [o.token_id for o in want]
    assert engine.block_manager.check_all_free()
