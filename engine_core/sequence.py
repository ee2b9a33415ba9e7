"""A request inside the engine: its tokens, how many have KV computed, and its block table."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine_core.sampling.params import SamplingParams

if TYPE_CHECKING:
    from engine_core.kv.transfer import KvImported
    from engine_core.lora.adapter import LoraAdapter
    from engine_core.structured.matcher import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = 0  # monotonic admission order, for first-come-first-served
    arrival_time: float = 0.0  # time.monotonic() when added
    first_scheduled_time: float | None = None  # when it first got compute: arrival → this is queue time
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache
    generator: torch.Generator | None = None
    seed: int | None = None
    # prompt-token logprobs (TGI decoder_input_details): entry i is the logprob of prompt token i+1
    prompt_logprobs: list[TokenLogprob] | None = None
    num_preemptions: int = 0
    grammar: GrammarState | None = None  # set for a constrained request; dropped when it finishes
    lora: LoraAdapter | None = None  # the adapter it runs with (SamplingParams.adapter, resolved); None: the base
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step (speculative decoding)
    kv_export: str | None = None  # prefill/decode: export the prompt's KV under this transfer id after token 1
    kv_export_inline: bool = False  # ...into the handle itself rather than a shared-memory file
    kv_imported: KvImported | None = None  # how its prompt's KV came from a prefill engine (reported once)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs and self.prompt_logprobs is None
