"""Helpers for engine tests: staggered arrivals and HF reference generation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine_core import LLMEngine, RequestOutput, SamplingParams
from engine_core.model_runner import PreparedBatch


@pytest.fixture(autouse=True)
def all_blocks_free_after_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Imported by an engine test module: after each test using its `engine`, nothing runs and no block is held."""
    yield
    if "engine" in request.fixturenames:
        engine = request.getfixturevalue("engine")
        assert not engine.has_unfinished() and engine.block_manager.check_all_free()


def chat(engine: LLMEngine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)


def run_staggered(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
                  arrive_at_step: list[int]) -> list[list[RequestOutput]]:
    """Add prompt i just before step arrive_at_step[i]; step until all are done."""
    results: dict[str, list[RequestOutput]] = {}
    step = 0
    pending = sorted(range(len(prompts)), key=lambda i: arrive_at_step[i])
    while pending or engine.has_unfinished():
        while pending and arrive_at_step[pending[0]] <= step:
            i = pending.pop(0)
            results[f"r{i}"] = []
            engine.add_request(f"r{i}", prompts[i], params[i])
        for out in engine.step():
            results[out.request_id].append(out)
        step += 1
    return [results[f"r{i}"] for i in range(len(prompts))]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def scheduled_decode_step(engine: LLMEngine, prompts: list[list[int]], warm_steps: int = 2) -> PreparedBatch:
    """Add the prompts, run `warm_steps` steps (the prefills, then decodes), and return the next step's
    model inputs, scheduled but not run: for calling model.forward on the same step more than one way."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=warm_steps + 8, ignore_eos=True))
    for _ in range(warm_steps):
        engine.step()
    batch = engine.scheduler.schedule()
    assert all(n == 1 for n in batch.num_new_tokens)
    return engine.runner.prepare(batch)
