"""Which replica was sent which prompt prefix: chained block hashes, bounded per replica, LRU.

A prompt is cut into fixed-size blocks (token ids when the gateway tokenized it, else characters);
block i's hash covers block i and, through the previous hash, everything before it, as vLLM's prefix
cache keys its KV blocks. So "replica R holds hash h_i" means R was sent this exact first i+1 blocks
and (unless its own cache evicted them since) can reuse their KV. This is the "approximate" index of
llm-d's prefix scorer and SGLang's router: no engine feedback, only what this gateway routed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from backends.base import ChatMessage, GenerationRequest


def _chain(blocks: list[bytes]) -> list[int]:
    hashes: list[int] = []
    parent = b""
    for block in blocks:
        digest = hashlib.blake2b(parent + block, digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big"))
        parent = digest
    return hashes


def token_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
    """Hashes of the full blocks only: an engine caches no partial block."""
    count = min(len(token_ids) // block_size, max_blocks)
    return _chain([array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes() for i in range(count)])


def text_block_hashes(text: str, block_chars: int, max_blocks: int) -> list[int]:
    count = min(len(text) // block_chars, max_blocks)
    return _chain([text[i * block_chars:(i + 1) * block_chars].encode() for i in range(count)])


def routing_text(messages: list[ChatMessage]) -> str:
    """Chat messages as one text, in order, roles included: close to what the upstream's template
    renders (which the gateway does not apply for chat-native upstreams), stable for equal prefixes."""
    return "".join(f"<{m.role}>{m.content or ''}" + "".join(f"<call {c.name}>{c.arguments}" for c in m.tool_calls)
                   for m in messages)


def request_block_hashes(request: GenerationRequest, block_tokens: int, block_chars: int,
                         max_blocks: int) -> list[int]:
    if request.prompt_token_ids:
        return token_block_hashes(request.prompt_token_ids, block_tokens, max_blocks)
    if request.prompt is not None:
        return text_block_hashes(request.prompt, block_chars, max_blocks)
    return text_block_hashes(routing_text(request.messages or []), block_chars, max_blocks)


def prompt_tokens(request: GenerationRequest) -> int:
    """The prompt's length in tokens, or an estimate when the gateway did not tokenize it."""
    if request.prompt_token_ids:
        return len(request.prompt_token_ids)
    if request.prompt is not None:
        return len(request.prompt) // 4  # about 4 characters a token (llm-d's estimate too)
    return sum(len(m.content or "") for m in request.messages or []) // 4


class PrefixIndex:
    """hash → the replicas holding it, plus one LRU of hashes per replica (`capacity` each), so
    memory is bounded by replicas × capacity whatever the traffic."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.holders: dict[int, set[str]] = {}
        self.lru: dict[str, OrderedDict[int, None]] = {}

    def insert(self, replica: str, hashes: list[int]) -> None:
        lru = self.lru.setdefault(replica, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self.holders.setdefault(h, set()).add(replica)
        while len(lru) > self.capacity:
            old, _ = lru.popitem(last=False)
            self._drop(old, replica)

    def match(self, hashes: list[int]) -> dict[str, int]:
        """Per replica, how many leading blocks of the prompt it holds (consecutive from the first)."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self.holders.get(h, set())
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for replica in alive:
                matched[replica] = i + 1
        return matched

    def blocks(self, replica: str) -> int:
        return len(self.lru.get(replica, ()))

    def forget(self, replica: str) -> None:
        """A replica that left the pool: its entries go (its cache went with it)."""
        for h in self.lru.pop(replica, OrderedDict()):
            self._drop(h, replica)

    def _drop(self, h: int, replica: str) -> None:
        holders = self.holders.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self.holders[h]
