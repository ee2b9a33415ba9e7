"""The engine's GPU path, wired end to end: Triton attention inside the engine, and decode steps padded to
graph buckets. On a machine without CUDA the kernels run in the Triton interpreter (fp32, tiny model)
and the bucketed steps run eagerly; on a CUDA machine (benchmarks/gpu_check.sh) the last test captures
and replays real CUDA graphs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine_core import EngineConfig, LLMEngine, SamplingParams
from engine_core.cuda_graphs import DecodeGraphs
from tests.engine_helpers import random_prompts, scheduled_decode_step

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _engine(model_dir: Path, backend: str, **overrides) -> LLMEngine:  # type: ignore[no-untyped-def]
    settings = dict(model=str(model_dir), dtype="float32", num_blocks=64, max_num_seqs=8, max_model_len=256,
                    attention_backend=backend, device=DEVICE, cuda_graphs=False)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def _tokens(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return [[o.token_id for o in r] for r in outputs]


def test_engine_on_triton_attention_generates_what_the_reference_engine_does(tiny_llama_dir: Path) -> None:
    prompts = random_prompts(3, [5, 40], 49152, seed=21)  # a prompt over two blocks, and ragged lengths
    triton_engine = _engine(tiny_llama_dir, "triton")
    assert type(triton_engine.model.attention).__name__ == "TritonAttention"
    want = _tokens(_engine(tiny_llama_dir, "torch", device="cpu"), prompts, 6)
    assert _tokens(triton_engine, prompts, 6) == want
    assert triton_engine.block_manager.check_all_free()


def test_a_decode_step_padded_to_its_bucket_matches_the_unpadded_step(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, "triton")
    prepared = scheduled_decode_step(engine, random_prompts(3, [10, 30], 49152, seed=22))
    model = engine.model
    before = [c.clone() for c in model.k_caches + model.v_caches]
    eager = model.forward(prepared.input_ids, prepared.positions, prepared.meta)
    after_eager = [c.clone() for c in model.k_caches + model.v_caches]
    graphs = DecodeGraphs(model, max_batch=8, max_model_len=256, block_size=16, capture=torch.cuda.is_available())
    assert graphs.buckets[:3] == [1, 2, 4]
    padded = graphs.forward(prepared.input_ids, prepared.positions, prepared.meta)  # 3 rows in bucket 4
    assert padded is not None and padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
    # the step's own slots hold its keys and values again; no other slot changed (the padding row's is -1)
    written = prepared.meta.slot_mapping.cpu()
    untouched = torch.ones(before[0].shape[0] * before[0].shape[1], dtype=torch.bool)
    untouched[written] = False
    for old, first, now in zip(before, after_eager, model.k_caches + model.v_caches):
        old, first, now = (t.flatten(0, 1).cpu() for t in (old, first, now))
        assert torch.equal(now[untouched], old[untouched])
        torch.testing.assert_close(now[written], first[written], rtol=1e-4, atol=1e-4)
    # steps with a prefill chunk, or more sequences than the largest bucket, run eagerly
    with_prefill = dataclasses.replace(prepared.meta, max_seqlen_q=2)
    assert graphs.forward(prepared.input_ids, prepared.positions, with_prefill) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_engine_with_graphs_generates_what_it_does_without(tiny_llama_dir: Path) -> None:
    prompts = random_prompts(5, [5, 60], 49152, seed=23)
    with_graphs = _engine(tiny_llama_dir, "auto", cuda_graphs=True)
    assert with_graphs.runner.graphs is not None and with_graphs.runner.graphs.graphs
    assert _tokens(with_graphs, prompts, 12) == _tokens(_engine(tiny_llama_dir, "auto"), prompts, 12)
