"""The fixed pool of KV-cache blocks: ref counts, an LRU free list, and optional prefix caching.

Block ids index the first dimension of every layer's KV tensors. A free block keeps its prefix
hash until it is handed out again, so a later request with the same prefix can reuse it (vLLM's
lazy eviction). Freed blocks join the tail of the free list in reverse order, so the tail of a
chain is evicted before its head.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine_core.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)  # kept to verify a prefix-cache hit


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block, chained through its parent so equal blocks at different prefixes differ."""
    return hash((parent_hash, token_ids))


def root_hash(seq: Sequence) -> int | None:
    """The parent of a sequence's first block: its adapter's (a fresh id per load), so KV computed under
    one adapter, or under the base model, is never reused for another."""
    return None if seq.lora is None else hash(("lora", seq.lora.uid))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = 0  # blocks looked up in the prefix cache
        self.prefix_hits = 0
        self._last_lookup = (0, 0)  # (queries, hits) of the last match_prefix, for unmatch

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` enough blocks to hold `num_new_tokens` more tokens of KV."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # lazily evict its prefix-cache entry
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    # prefix caching

    def match_prefix(self, seq: Sequence) -> None:
        """Before a sequence's first allocation, reuse cached blocks that hold its prefix."""
        self._last_lookup = (0, 0)
        if not self.enable_prefix_caching or seq.block_table:
            return
        bs = self.block_size
        parent = root_hash(seq)
        queries = 0
        # the last token is always recomputed: its logits are needed to sample
        for start in range(0, seq.num_tokens - 1 - bs + 1, bs):
            tokens = tuple(seq.token_ids[start:start + bs])
            block_hash = chain_hash(parent, tokens)
            queries += 1
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            parent = block_hash
        seq.num_computed_tokens = len(seq.block_table) * bs
        seq.num_cached_tokens = seq.num_computed_tokens
        self._last_lookup = (queries, len(seq.block_table))
        self.prefix_queries += queries
        self.prefix_hits += len(seq.block_table)

    def unmatch(self, seq: Sequence) -> None:
        """Undo the match_prefix just made for `seq`, which cannot start after all: its blocks go back (still
        cached, to be matched again when it starts), and so does the lookup's count (made again then)."""
        queries, hits = self._last_lookup
        self.prefix_queries -= queries
        self.prefix_hits -= hits
        self._last_lookup = (0, 0)
        self.free(seq)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that computed tokens have filled, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = root_hash(seq)
        for index in range(seq.num_computed_tokens // bs):
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is None:
                tokens = tuple(seq.token_ids[index * bs:(index + 1) * bs])
                block.block_hash = chain_hash(parent, tokens)
                block.token_ids = tokens
                self.hash_to_block.setdefault(block.block_hash, block.block_id)
            parent = block.block_hash

    def check_all_free(self) -> bool:
        return self.num_free_blocks == self.num_blocks and all(b.ref_count == 0 for b in self.blocks)
