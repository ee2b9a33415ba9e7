"""A prompt's KV leaving one engine and entering another (prefill/decode disaggregation).

A prefill engine runs a request's prompt and samples its first token as usual; then, instead of decoding on,
it *exports*: every layer's K and V rows of the prompt, in the cache's dtype, are copied into a file in shared
memory (`/dev/shm` where there is one; transport "shm", for workers on one host), or into the handle itself
(transport "inline": the bytes then travel in the workers' ZeroMQ messages, for workers that share no memory),
and the request is *parked*: it leaves the batch but keeps its blocks
until it is released (the decode side has the KV, or gave up), so nothing is freed before the handover ends.
A decode engine *imports*: it allocates blocks, copies the rows in, and goes on from the first token as if it
had prefilled the prompt itself. The layout travels with the handle and is checked on import; a mismatch, a
missing or short file, or no free blocks makes the decode engine prefill locally instead (same tokens, later).

File layout: for each layer, K then V, each `[num_tokens, num_kv_heads, head_dim]`, contiguous.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_core.sequence import Sequence

PREFIX = "llmgw-kv-"


def transfer_dir() -> Path:
    """Where handover files live: memory-backed /dev/shm on Linux (no disk I/O), else the temp directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def transfer_path(transfer_id: str) -> Path:
    if not transfer_id or not all(c.isalnum() or c in "-_" for c in transfer_id):
        raise ValueError(f"a KV transfer id is letters, digits, '-' and '_' only, not {transfer_id!r}")
    return transfer_dir() / f"{PREFIX}{transfer_id}"


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What must be equal on both sides for rows to mean the same thing."""

    model: str  # the model directory's name
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16", "float32"

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _dtype(self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class KvExport:
    """A prefill engine's instruction: after the first token, export the prompt's KV under this id."""

    transfer_id: str
    inline: bool = False  # the KV in the handle's `data` rather than in a shared-memory file


@dataclass(frozen=True, slots=True)
class KvHandle:
    """What a prefill engine wrote, and what a decode engine is given to continue the request."""

    transfer_id: str
    num_tokens: int  # prompt tokens whose KV the file holds
    first_token: int  # the token the prefill engine sampled (the client already has it)
    layout: KvLayout
    generator_state: bytes | None = None  # a seeded request's sampler generator after the first token
    data: bytes | None = None  # the KV itself (inline transport); None: in the transfer file
    num_bytes: int = 0
    seconds: float = 0.0  # time to write the file


@dataclass(frozen=True, slots=True)
class KvImported:
    """How a decode engine took a handle: `imported` False means it prefilled locally, and `reason` says why."""

    imported: bool
    num_bytes: int = 0
    seconds: float = 0.0
    reason: str | None = None


def layout_of(model_name: str, k_caches: list[torch.Tensor]) -> KvLayout:
    _, _, heads, dim = k_caches[0].shape
    return KvLayout(model_name, len(k_caches), heads, dim, str(k_caches[0].dtype).removeprefix("torch."))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown KV dtype {name!r}")
    return dtype


def _slots(block_table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Row index in a layer's cache viewed as [num_blocks * block_size, heads, dim], per token position."""
    positions = torch.arange(num_tokens)
    blocks = torch.tensor(block_table, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


def export_kv(seq: Sequence, num_tokens: int, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
              layout: KvLayout, transfer_id: str, first_token: int, inline: bool = False) -> KvHandle:
    """Write the first `num_tokens` positions of `seq`'s KV to its transfer file (or, inline, into the handle)."""
    started = time.perf_counter()
    slots = _slots(seq.block_table, num_tokens, k_caches[0].shape[1])
    total = 2 * layout.num_layers * num_tokens * layout.num_kv_heads * layout.head_dim
    out = torch.empty(total, dtype=k_caches[0].dtype) if inline else \
        torch.from_file(str(transfer_path(transfer_id)), shared=True, size=total, dtype=k_caches[0].dtype)
    rows = out.view(layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
    for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
        torch.index_select(k.view(-1, layout.num_kv_heads, layout.head_dim), 0, slots, out=rows[layer, 0])
        torch.index_select(v.view(-1, layout.num_kv_heads, layout.head_dim), 0, slots, out=rows[layer, 1])
    data = out.view(torch.uint8).numpy().tobytes() if inline else None
    del out, rows  # unmaps; the file stays
    state = bytes(seq.generator.get_state().numpy().tobytes()) if seq.generator is not None else None
    return KvHandle(transfer_id, num_tokens, first_token, layout, state, data, num_tokens * layout.bytes_per_token(),
                    time.perf_counter() - started)


def check_handle(handle: KvHandle, layout: KvLayout, prompt_len: int) -> str | None:
    """Why `handle` cannot be imported here, or None when it can."""
    if handle.layout != layout:
        return f"KV layout {handle.layout} differs from this engine's {layout}"
    if handle.num_tokens != prompt_len:
        return f"the handle holds {handle.num_tokens} tokens of KV for a prompt of {prompt_len}"
    expected = handle.num_tokens * layout.bytes_per_token()
    if handle.data is not None:
        size = len(handle.data)
    else:
        try:
            size = transfer_path(handle.transfer_id).stat().st_size
        except OSError as exc:
            return f"the KV file is not there ({exc.strerror})"
    if size != expected:
        return f"the KV has {size} bytes, not {expected}"
    return None


def import_kv(seq: Sequence, handle: KvHandle, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
    """Copy the handle's rows into `seq`'s blocks (already allocated for `handle.num_tokens` tokens)."""
    layout = handle.layout
    slots = _slots(seq.block_table, handle.num_tokens, k_caches[0].shape[1])
    dtype = k_caches[0].dtype
    total = 2 * layout.num_layers * handle.num_tokens * layout.num_kv_heads * layout.head_dim
    src = torch.frombuffer(bytearray(handle.data), dtype=dtype) if handle.data is not None else \
        torch.from_file(str(transfer_path(handle.transfer_id)), shared=False, size=total, dtype=dtype)
    src = src.view(layout.num_layers, 2, handle.num_tokens, layout.num_kv_heads, layout.head_dim)
    for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
        k.view(-1, layout.num_kv_heads, layout.head_dim).index_copy_(0, slots, src[layer, 0])
        v.view(-1, layout.num_kv_heads, layout.head_dim).index_copy_(0, slots, src[layer, 1])


def restore_generator(state: bytes) -> torch.Generator:
    generator = torch.Generator()
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


def remove_transfer(transfer_id: str) -> None:
    """Delete a transfer's file, if it is still there (either side may, and the gateway does at the end)."""
    try:
        transfer_path(transfer_id).unlink(missing_ok=True)
    except (OSError, ValueError):
        pass
