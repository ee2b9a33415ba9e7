"""A worker's figures in the shape of the engine attributes the gateway's engine metrics read
(`LLMEngine.scheduler.running`, `.block_manager.num_free_blocks`, `.last_step`, `.spec.counters`, ...), so
one metrics collector serves the in-process engine and the worker alike."""

from __future__ import annotations

from dataclasses import dataclass

from backends.engine_worker.messages import SpecFigures, StepFigures, WorkerLoad
from engine_core.spec_decode import SpecCounters


@dataclass(frozen=True, slots=True)
class SchedulerFigures:
    running: range  # only its length is read: the number of sequences
    waiting: range
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class BlockFigures:
    num_blocks: int
    num_free_blocks: int
    prefix_queries: int
    prefix_hits: int


@dataclass(frozen=True, slots=True)
class SpecMethod:
    method: str


@dataclass(frozen=True, slots=True)
class SpecDecodeFigures:
    """Shaped like `LLMEngine.spec` (a SpecDecoder): `.config.method` and `.counters`."""
    config: SpecMethod
    counters: SpecCounters


@dataclass(frozen=True, slots=True)
class EngineFigures:
    scheduler: SchedulerFigures
    block_manager: BlockFigures
    last_step: StepFigures | None = None
    spec: SpecDecodeFigures | None = None  # None: speculative decoding off


def spec_figures(spec: SpecFigures | None) -> SpecDecodeFigures | None:
    if spec is None:
        return None
    counters = SpecCounters(num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
                            num_accepted_tokens=spec.num_accepted_tokens, num_emitted_tokens=spec.num_emitted_tokens,
                            accepted_per_pos=list(spec.accepted_per_pos))
    return SpecDecodeFigures(SpecMethod(spec.method), counters)


def engine_figures(load: WorkerLoad, step: StepFigures | None = None) -> EngineFigures:
    return EngineFigures(
        scheduler=SchedulerFigures(range(load.running), range(load.waiting), load.preemptions),
        block_manager=BlockFigures(load.kv_blocks_total, load.kv_blocks_free, load.prefix_cache_queries,
                                   load.prefix_cache_hits),
        last_step=step, spec=spec_figures(load.spec))
