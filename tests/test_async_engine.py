"""The async engine: streams per request, a free event loop while computing, abort on disconnect."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from engine_core import AsyncEngine, EngineConfig, LLMEngine, RequestError, SamplingParams
from tests.engine_helpers import random_prompts
from tests.server import WAIT


@pytest.fixture
async def aengine(smollm_dir: Path) -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(smollm_dir), dtype="float32", num_blocks=300)))
    yield engine
    engine.shutdown()
    assert engine.engine.block_manager.check_all_free()


async def test_concurrent_streams_each_end_with_one_finish(aengine: AsyncEngine) -> None:
    prompts = random_prompts(6, [8, 30, 60], 49152)

    async def consume(prompt: list[int], n: int) -> list:
        return [o async for o in aengine.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))]

    results = await asyncio.gather(*(consume(p, 5 + i) for i, p in enumerate(prompts)))
    for i, outs in enumerate(results):
        assert len(outs) == 5 + i and [o.finished for o in outs].count(True) == 1 and outs[-1].finished


def count_steps(engine: AsyncEngine) -> list[int]:
    """The engine's steps so far, counted by a step listener (it runs in the engine thread after each)."""
    steps = [0]
    engine.step_listeners.append(lambda _: steps.__setitem__(0, steps[0] + 1))
    return steps


async def until(condition: Callable[[LLMEngine], bool], engine: AsyncEngine, what: str) -> None:
    """Wait, checking between steps in the engine thread, for `condition`; bounded only to fail, not hang."""
    deadline = time.monotonic() + WAIT
    while not await engine.call(condition):
        assert time.monotonic() < deadline, f"not within {WAIT:g} s: {what}"
        await asyncio.sleep(0.01)


async def test_event_loop_stays_responsive_while_the_model_computes(aengine: AsyncEngine,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """By order, not by the clock: the loop's ticker runs while a step is computing."""
    computing = [False]
    step = aengine.engine.step

    def marked_step() -> list:
        computing[0] = True
        try:
            return step()
        finally:
            computing[0] = False

    monkeypatch.setattr(aengine.engine, "step", marked_step)
    ticks = {"during a step": 0, "between steps": 0}

    async def ticker() -> None:
        while True:
            await asyncio.sleep(0.005)
            ticks["during a step" if computing[0] else "between steps"] += 1

    tick = asyncio.create_task(ticker())
    prompt = random_prompts(1, [200], 49152)[0]
    outs = [o async for o in aengine.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))]
    tick.cancel()
    assert len(outs) == 20
    assert ticks["during a step"] >= 1, ticks  # a step that held the loop would leave none


async def test_leaving_a_stream_early_aborts_and_frees_blocks_within_a_step(aengine: AsyncEngine) -> None:
    steps = count_steps(aengine)
    stream = aengine.generate(random_prompts(1, [64], 49152)[0], SamplingParams(max_new_tokens=500, ignore_eos=True))
    async for out in stream:
        if out.num_output_tokens == 3:
            break
    await stream.aclose()
    left_at = steps[0]
    await until(lambda e: e.block_manager.check_all_free() and not e.has_unfinished(), aengine, "the blocks freed")
    assert steps[0] - left_at <= 1  # at most the step under way when it left; free before the next one


async def test_cancelled_task_aborts_its_request(aengine: AsyncEngine) -> None:
    steps = count_steps(aengine)
    generating = asyncio.Event()

    async def consume() -> None:
        async for _ in aengine.generate([1, 2, 3], SamplingParams(max_new_tokens=1000, ignore_eos=True)):
            generating.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(generating.wait(), WAIT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    cancelled_at = steps[0]
    await until(lambda e: not e.has_unfinished(), aengine, "the request aborted")
    assert steps[0] - cancelled_at <= 1
    assert await aengine.call(lambda e: e.block_manager.check_all_free())


async def test_bad_request_raises_in_the_stream(aengine: AsyncEngine) -> None:
    with pytest.raises(RequestError, match="empty"):
        async for _ in aengine.generate([], SamplingParams()):
            pass
