"""Continuous batching: one token-budget loop per step (vLLM v1's semantics).

There is no prefill or decode phase. Each running sequence is given the tokens it still lacks
KV for (its whole prompt, a chunk of it, or the one token sampled last step), running sequences
first, then waiting ones in arrival order. When blocks run out the most recently admitted
running sequence is preempted: its blocks are freed and it is recomputed later.

`long_prefill_token_threshold` (vLLM's): above 0, no prompt is given more than that many tokens in one
step, so a long prompt's chunk leaves budget for the prompts behind it instead of taking the whole step:
a short prompt that arrives while a long one prefills starts in the next step, not after the long one.

A decoding sequence with drafts (speculative decoding) is given its last token and its drafts, inside
the same budget (vLLM's num_tokens_with_spec); drafts that do not fit the budget or the free blocks are
cut, never a reason to preempt.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine_core.kv.block_manager import BlockManager
from engine_core.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens to compute for each sequence this step, its drafts included
    spec_token_ids: list[list[int]] = field(default_factory=list)  # the drafts each verifies ([]: none)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int = 1, long_prefill_token_threshold: int = 0) -> None:
        self.block_manager = block_manager
        # a prompt's tokens in one step at most (0: the budget's): caps a long prefill's chunk, never a decode
        self.token_cap = long_prefill_token_threshold or max_num_batched_tokens
        self.max_loras = max_loras  # distinct LoRA adapters in one step
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        preempted = False
        adapters: set[int] = set()  # the step's LoRA adapters, by uid

        def adapter_fits(seq: Sequence) -> bool:
            return seq.lora is None or seq.lora.uid in adapters or len(adapters) < self.max_loras

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.lora is not None and not adapter_fits(seq):  # a step holds max_loras adapters: next step
                index += 1
                continue
            lacking = seq.num_tokens - seq.num_computed_tokens
            num_new = min(lacking + len(seq.spec_token_ids), budget)
            if lacking > self.token_cap:  # the next chunk of a long prompt
                num_new = min(num_new, self.token_cap)
            if num_new > lacking and not self.block_manager.can_allocate(seq, num_new):
                num_new = min(lacking, budget)
            drafts = seq.spec_token_ids[:max(0, num_new - lacking)]
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running.pop()  # the last admitted; never one already scheduled
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, num_new)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                batch.spec_token_ids.append(drafts)
                budget -= num_new
                index += 1
                if seq.lora is not None:
                    adapters.add(seq.lora.uid)

        # a step that had to preempt admits nobody new: the pool is already too small
        skipped: list[Sequence] = []  # waiting behind an adapter that does not fit this step; keep their order
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora is not None and not adapter_fits(seq):
                skipped.append(self.waiting.popleft())
                continue
            self.block_manager.match_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget, self.token_cap)
            if not self.block_manager.can_allocate(seq, num_new):
                # give back the cached blocks it matched (they stay cached, to match again next step): held by a
                # sequence that waits, they could starve the ones ahead of it, which a preemption puts there, and
                # with nothing running no step would ever free a block again
                self.block_manager.unmatch(seq)
                break
            self.block_manager.allocate(seq, num_new)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            batch.spec_token_ids.append([])
            budget -= num_new
            if seq.lora is not None:
                adapters.add(seq.lora.uid)
        self.waiting.extendleft(reversed(skipped))
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
