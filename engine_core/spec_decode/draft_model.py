"""A draft model: a smaller model with the target's tokenizer, run by this engine with a KV cache of its own.

Each request has a shadow sequence in the draft's cache. A proposal first rolls the shadow back to what
the target kept (its drafts past the first rejected one are dropped; their KV slots are overwritten),
catches it up on the tokens the target emitted since, then runs k greedy steps for all proposing requests
at once. Greedy drafts are deterministic (q = δ_d), so the engine's verification stays exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine_core.attention import AttentionBackend
from engine_core.kv.block_manager import BlockManager
from engine_core.loader import load_state_dict, load_tokenizer, resolve_model_dir
from engine_core.model_runner import ModelRunner
from engine_core.models.registry import build_model, load_model_args
from engine_core.sampling.params import SamplingParams
from engine_core.sampling.sampler import Sampler
from engine_core.scheduler import ScheduledBatch
from engine_core.sequence import Sequence

GREEDY = SamplingParams(temperature=0.0)


class DraftModelProposer:
    def __init__(self, source: str, target_vocab: dict[str, int], target_vocab_size: int, dtype: torch.dtype,
                 max_model_len: int, attention: AttentionBackend, device: torch.device, quantization: str,
                 num_blocks: int, block_size: int) -> None:
        self.model_dir: Path = resolve_model_dir(source)
        args = load_model_args(self.model_dir)
        if args.vocab_size != target_vocab_size or load_tokenizer(self.model_dir).get_vocab() != target_vocab:
            raise ValueError(f"draft model {source}: its tokenizer or vocabulary ({args.vocab_size} ids) differs "
                             f"from the target's ({target_vocab_size}); a draft must share the tokenizer")
        state = load_state_dict(self.model_dir, keep_quantized=quantization == "auto")
        self.max_model_len = min(max_model_len, args.max_position_embeddings)
        self.model = build_model(args, state, dtype, self.max_model_len, attention, device, quantization)
        self.model.allocate_kv_cache(num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size)
        self.runner = ModelRunner(self.model, block_size, Sampler(()))
        self.shadows: dict[str, Sequence] = {}
        self.synced: dict[str, int] = {}  # request -> tokens its shadow copied last time (equal ever since)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        # (shadow, where its drafts start, how many it may draft) for each request that drafts
        drafting = {seq.request_id: (self._follow(seq), seq.num_tokens, k) for seq, k in zip(seqs, limits)
                    if seq.num_tokens + k <= self.max_model_len}
        for _ in range(max(limits, default=0)):
            batch = ScheduledBatch([], [])
            for request_id, (shadow, start, k) in list(drafting.items()):
                num_new = shadow.num_tokens - shadow.num_computed_tokens
                if shadow.num_tokens - start >= k:
                    continue
                if not self.blocks.can_allocate(shadow, num_new):  # the draft's cache is full: no drafts here
                    self._drop(request_id)
                    del drafting[request_id]
                    continue
                self.blocks.allocate(shadow, num_new)
                batch.seqs.append(shadow)
                batch.num_new_tokens.append(num_new)
            if not batch.seqs:
                break
            sampled, result, _ = self.runner.run(batch)
            for shadow, n in zip(batch.seqs, batch.num_new_tokens):
                shadow.num_computed_tokens += n
            for shadow, token in zip(sampled, result.token_ids if result else []):
                shadow.token_ids.append(token)
        return [drafting[s.request_id][0].token_ids[drafting[s.request_id][1]:] if s.request_id in drafting else []
                for s in seqs]

    def _follow(self, seq: Sequence) -> Sequence:
        """Bring the shadow to the target's tokens: keep the KV of the longest common prefix."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            shadow = self.shadows[seq.request_id] = Sequence(seq.request_id, list(seq.prompt_token_ids), GREEDY)
        limit = min(shadow.num_computed_tokens, seq.num_tokens - 1)
        common = min(self.synced.get(seq.request_id, 0), limit)  # only the drafts after it can differ
        while common < limit and shadow.token_ids[common] == seq.token_ids[common]:
            common += 1
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed_tokens = common
        self.synced[seq.request_id] = seq.num_tokens
        return shadow

    def _drop(self, request_id: str) -> None:
        self.synced.pop(request_id, None)
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.blocks.free(shadow)

    def finish(self, seq: Sequence) -> None:
        self._drop(seq.request_id)
