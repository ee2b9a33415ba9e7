"""Decode steps on CUDA replayed from graphs captured once per batch-size bucket.

A decode step launches hundreds of small kernels (about fifteen per layer); at small batch, launching
them costs more than the work. At start-up the engine captures one graph per bucket size; a step of B
decoding sequences then pads to the smallest bucket of at least B and replays it. Padding rows write
their keys and values to slot -1, which the KV-write kernel skips, and attend to one key of whatever
block their table row names (a read only); their outputs are dropped. Everything a replay reads lives in
static buffers that each step fills by copies; the attention backend must not read values back to the
host (TritonAttention does not), and the decode kernel's context split is fixed by max_model_len.
"""

from __future__ import annotations

import torch

from engine_core.attention import AttentionMetadata
from engine_core.models.decoder import DecoderModel

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model: DecoderModel, max_batch: int, max_model_len: int, block_size: int,
                 capture: bool = True) -> None:
        """capture=False runs the same padded steps eagerly: what the tests check on a machine with no GPU."""
        self.model = model
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // block_size)
        size, device = self.buckets[-1], model.device
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.full((size,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((size, self.width), dtype=torch.int32, device=device)
        self.cu_seqlens = torch.arange(size + 1, dtype=torch.int32, device=device)  # one query per row
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:bucket], cu_seqlens_q=self.cu_seqlens[:bucket + 1],
            seq_lens=self.seq_lens[:bucket], block_table=self.block_table[:bucket], max_seqlen_q=1,
            max_seqlen_k=self.max_model_len, query_lens=[1] * bucket, seq_lens_host=[self.max_model_len] * bucket)
        return self.model.forward(self.input_ids[:bucket], self.positions[:bucket], meta)

    def _capture(self) -> None:
        pool = None
        for bucket in reversed(self.buckets):  # the largest first: the smaller ones fit in its memory pool
            self._forward(bucket)  # warm-up outside the capture: Triton compiles its kernels here
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states of a decode-only step, or None when the step does not fit a graph."""
        batch, width = meta.num_seqs, meta.block_table.shape[1]
        if meta.max_seqlen_q != 1 or batch > self.buckets[-1] or width > self.width:
            return None
        bucket = next(b for b in self.buckets if b >= batch)
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slots[:batch].copy_(meta.slot_mapping)
        self.slots[batch:bucket].fill_(-1)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.seq_lens[batch:bucket].fill_(1)
        self.block_table[:batch, :width].copy_(meta.block_table)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:batch]
        return self._forward(bucket)[:batch]
