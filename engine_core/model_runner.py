"""Build the flat batch for a scheduled step, run the model, and sample."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_core.attention import AttentionMetadata
from engine_core.cuda_graphs import DecodeGraphs
from engine_core.lora import LoraBatch, LoraRegistry
from engine_core.models.decoder import DecoderModel
from engine_core.sampling.sampler import Sampler, SampleResult, prompt_logprobs
from engine_core.scheduler import ScheduledBatch
from engine_core.sequence import Sequence, TokenLogprob


@dataclass(slots=True)
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # row of each sampling sequence's last token
    sample_seqs: list[Sequence]
    prompt_rows: dict[int, tuple[int, int]]  # seq index -> rows whose logits score prompt tokens
    lora: LoraBatch | None = None  # each row's adapter delta; None when no row has an adapter
    verify_rows: list[int] = field(default_factory=list)  # each drafting sequence's last 1 + len(drafts) rows
    verify_seqs: list[Sequence] = field(default_factory=list)


@dataclass(slots=True)
class VerifyBatch:
    """What a step's drafting sequences verify: logits[offsets[i] + j] scores the position of drafts[i][j]
    (and the row after a sequence's last draft, its bonus token)."""
    seqs: list[Sequence]
    drafts: list[list[int]]
    offsets: list[int]
    logits: torch.Tensor


class ModelRunner:
    def __init__(self, model: DecoderModel, block_size: int, sampler: Sampler) -> None:
        self.model = model
        self.block_size = block_size
        self.sampler = sampler
        self._prompt_logprobs: dict[str, list[TokenLogprob]] = {}  # accumulated over prefill chunks
        self.graphs: DecodeGraphs | None = None  # set by the engine on CUDA
        self.loras: LoraRegistry | None = None  # set by the engine

    def prepare(self, batch: ScheduledBatch) -> PreparedBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_rows: dict[int, tuple[int, int]] = {}
        verify_rows: list[int] = []
        verify_seqs: list[Sequence] = []
        for index, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            drafts = batch.spec_token_ids[index] if batch.spec_token_ids else []
            input_ids.extend(seq.token_ids[start:end - len(drafts)])
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if seq.wants_prompt_logprobs() and start < seq.num_prompt_tokens - 1:
                last = min(end, seq.num_prompt_tokens - 1)  # the last prompt token scores nothing
                prompt_rows[index] = (cu_seqlens[-1], cu_seqlens[-1] + last - start)
            cu_seqlens.append(cu_seqlens[-1] + n)
            seq_lens.append(end)
            if drafts:
                verify_rows.extend(range(cu_seqlens[-1] - len(drafts) - 1, cu_seqlens[-1]))
                verify_seqs.append(seq)
            elif end == seq.num_tokens:
                sample_rows.append(cu_seqlens[-1] - 1)
                sample_seqs.append(seq)
        width = max(len(s.block_table) for s in batch.seqs)
        block_table = torch.zeros((len(batch.seqs), width), dtype=torch.int32)
        for i, seq in enumerate(batch.seqs):
            block_table[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        device = self.model.device  # built on the host, copied once (a no-op on CPU)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32).to(device, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            block_table=block_table.to(device, non_blocking=True),
            max_seqlen_q=max(batch.num_new_tokens),
            max_seqlen_k=max(seq_lens),
            query_lens=list(batch.num_new_tokens),
            seq_lens_host=seq_lens,
        )
        lora = None
        if self.loras is not None and self.loras.adapters:
            lora = self.loras.batch([s.lora for s in batch.seqs], batch.num_new_tokens)
        return PreparedBatch(torch.tensor(input_ids, dtype=torch.long).to(device, non_blocking=True),
                             torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True),
                             meta, sample_rows, sample_seqs, prompt_rows, lora, verify_rows, verify_seqs)

    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], SampleResult | None, VerifyBatch | None]:
        """Sample the sequences without drafts; hand back the logits of those with drafts, which the engine
        verifies position by position (each position's sampling sees the tokens emitted before it)."""
        prepared = self.prepare(batch)
        hidden = None
        if self.graphs is not None and prepared.lora is None:  # graphs were captured without adapters
            hidden = self.graphs.forward(prepared.input_ids, prepared.positions, prepared.meta)
        if hidden is None:
            hidden = self.model.forward(prepared.input_ids, prepared.positions, prepared.meta, prepared.lora,
                                        exact=bool(prepared.verify_seqs))
        for index, (first, last) in prepared.prompt_rows.items():
            self._score_prompt(batch.seqs[index], self.model.compute_logits(hidden[first:last]))
        rows = prepared.sample_rows + prepared.verify_rows
        if not rows:
            return [], None, None
        # one LM-head call for sampled and verified rows
        logits = self.model.compute_logits(hidden[rows], exact=bool(prepared.verify_seqs))
        sampled = len(prepared.sample_rows)
        result = self.sampler(logits[:sampled], prepared.sample_seqs) if sampled else None
        verify = None
        if prepared.verify_seqs:
            drafts = [d for d in batch.spec_token_ids if d]
            offsets = [0]
            for draft in drafts[:-1]:
                offsets.append(offsets[-1] + len(draft) + 1)
            verify = VerifyBatch(prepared.verify_seqs, drafts, offsets, logits[sampled:])
        return prepared.sample_seqs, result, verify

    def _score_prompt(self, seq: Sequence, logits: torch.Tensor) -> None:
        start = seq.num_computed_tokens
        if start == 0:
            self._prompt_logprobs[seq.request_id] = []
        scored = self._prompt_logprobs.setdefault(seq.request_id, [])
        scored.extend(prompt_logprobs(logits, seq.token_ids[start + 1:start + 1 + logits.shape[0]]))
        if len(scored) == seq.num_prompt_tokens - 1:
            seq.prompt_logprobs = self._prompt_logprobs.pop(seq.request_id)

    def forget(self, request_id: str) -> None:
        self._prompt_logprobs.pop(request_id, None)
