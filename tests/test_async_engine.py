"""The async engine: streams per request, a free event loop while computing, abort on disconnect."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine_core import AsyncEngine, EngineConfig, LLMEngine, RequestError, SamplingParams
from tests.engine_helpers import random_prompts


@pytest.fixture
async def aengine(smollm_dir: Path) -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(smollm_dir), num_blocks=300)))
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


async def test_event_loop_stays_responsive_while_the_model_computes(aengine: AsyncEngine) -> None:
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    prompt = random_prompts(1, [200], 49152)[0]
    outs = [o async for o in aengine.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))]
    tick.cancel()
    assert len(outs) == 20 and len(gaps) > 10
    assert max(gaps) < 0.5  # the loop ticked throughout; no step blocked it


async def test_leaving_a_stream_early_aborts_and_frees_blocks_within_a_step(aengine: AsyncEngine) -> None:
    stream = aengine.generate(random_prompts(1, [64], 49152)[0], SamplingParams(max_new_tokens=500, ignore_eos=True))
    async for out in stream:
        if out.num_output_tokens == 3:
            break
    await stream.aclose()
    for _ in range(100):
        if await aengine.call(lambda e: e.block_manager.check_all_free() and not e.has_unfinished()):
            break
        await asyncio.sleep(0.01)
    assert await aengine.call(lambda e: e.block_manager.check_all_free())


async def test_cancelled_task_aborts_its_request(aengine: AsyncEngine) -> None:
    async def consume() -> None:
        async for _ in aengine.generate([1, 2, 3], SamplingParams(max_new_tokens=1000, ignore_eos=True)):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if await aengine.call(lambda e: not e.has_unfinished()):
            break
        await asyncio.sleep(0.01)
    assert await aengine.call(lambda e: e.block_manager.check_all_free())


async def test_bad_request_raises_in_the_stream(aengine: AsyncEngine) -> None:
    with pytest.raises(RequestError, match="empty"):
        async for _ in aengine.generate([], SamplingParams()):
            pass
