"""The Triton kernels (the GPU path) against the torch reference, on CPU under TRITON_INTERPRET=1
(set by conftest when there is no GPU) at small shapes, in fp32 and fp16: random block tables,
ragged lengths, GQA, caches poisoned with NaN wherever no sequence owns a slot, output buffers
poisoned before the call, fresh random inputs for each case."""

from __future__ import annotations

import pytest
import torch

from engine_core.attention import AttentionMetadata, TorchReferenceAttention

triton_paged = pytest.importorskip("engine_core.attention.triton_paged", reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 4, 2, 16, 16, 48


def tolerance(dtype: torch.dtype) -> float:
    return 2e-3 if dtype == torch.float32 else 2e-2


def paged_batch(total: list[int], new: list[int], dtype: torch.dtype, seed: int) -> dict:
    """Sequences with `total` tokens of which the last `new` are computed this step; earlier tokens are
    already in a NaN-poisoned cache at randomly chosen blocks."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    k_cache = torch.full((NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, slots, qs, ks, vs = [], [], [], [], []
    for n, m in zip(total, new):
        table = [order.pop() for _ in range(-(-n // BLOCK))]
        k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        for pos in range(n - m):
            k_cache[table[pos // BLOCK], pos % BLOCK] = k[pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = v[pos]
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n - m, n)]
        qs.append(torch.randn(m, HEADS, HEAD_DIM, generator=gen).to(dtype))
        ks.append(k[n - m:])
        vs.append(v[n - m:])
        tables.append(table)
    width = max(len(t) for t in tables)
    cu = [0]
    for m in new:
        cu.append(cu[-1] + m)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(total, dtype=torch.int32),
        block_table=torch.tensor([t + [order[0]] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_seqlen_q=max(new), max_seqlen_k=max(total), query_lens=list(new), seq_lens_host=list(total))
    return {"q": torch.cat(qs), "k": torch.cat(ks), "v": torch.cat(vs), "k_cache": k_cache, "v_cache": v_cache,
            "meta": meta}


def on_device(batch: dict) -> dict:
    meta = batch["meta"]
    moved = {k: v.to(DEVICE) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    moved["meta"] = AttentionMetadata(meta.slot_mapping.to(DEVICE), meta.cu_seqlens_q.to(DEVICE),
                                      meta.seq_lens.to(DEVICE), meta.block_table.to(DEVICE), meta.max_seqlen_q,
                                      meta.max_seqlen_k, meta.query_lens, meta.seq_lens_host)
    return moved


def reference(batch: dict) -> torch.Tensor:
    """The torch reference on float32 copies, poison removed (its padded gathers would spread NaN)."""
    f32 = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return TorchReferenceAttention().forward(f32["q"], f32["k"], f32["v"], f32["k_cache"].nan_to_num(0.0),
                                             f32["v_cache"].nan_to_num(0.0), f32["meta"], HEAD_DIM ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_fills_exactly_the_mapped_slots(dtype: torch.dtype) -> None:
    batch = on_device(paged_batch([5, 20, 3], [5, 4, 1], dtype, seed=1))
    k_cache, v_cache = batch["k_cache"].clone(), batch["v_cache"].clone()
    triton_paged.write_kv(batch["k"], batch["v"], k_cache, v_cache, batch["meta"].slot_mapping)
    want_k, want_v = batch["k_cache"].clone(), batch["v_cache"].clone()
    flat = (-1, KV_HEADS, HEAD_DIM)
    want_k.view(flat).index_copy_(0, batch["meta"].slot_mapping, batch["k"])
    want_v.view(flat).index_copy_(0, batch["meta"].slot_mapping, batch["v"])
    assert torch.equal(k_cache.nan_to_num(7.0), want_k.nan_to_num(7.0))  # untouched slots are still NaN
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_prefill_and_decode_attention_matches_the_reference(dtype: torch.dtype, seed: int) -> None:
    # a fresh prefill, a chunk over a cached prefix, decodes (one past a block boundary), a chunk of 20
    host = paged_batch([9, 40, 17, 1, 33, 60], [9, 6, 1, 1, 1, 20], dtype, seed)
    batch = on_device(host)
    meta = batch["meta"]
    triton_paged.write_kv(batch["k"], batch["v"], batch["k_cache"], batch["v_cache"], meta.slot_mapping)
    out = torch.full_like(batch["q"], float("nan"))
    triton_paged.paged_attention(batch["q"], batch["k_cache"], batch["v_cache"], meta.block_table, meta.seq_lens,
                                 meta.cu_seqlens_q, meta.max_seqlen_q, HEAD_DIM ** -0.5, out=out)
    assert not out.isnan().any()
    assert torch.allclose(out.float().cpu(), reference(host), atol=tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_split_kv_decode_matches_the_reference(dtype: torch.dtype, num_splits: int | None) -> None:
    total = [1, 16, 17, 70, 130]
    host = paged_batch(total, [1] * len(total), dtype, seed=5 + (num_splits or 0))
    batch = on_device(host)
    meta = batch["meta"]
    triton_paged.write_kv(batch["k"], batch["v"], batch["k_cache"], batch["v_cache"], meta.slot_mapping)
    out = torch.full_like(batch["q"], float("nan"))
    triton_paged.paged_decode(batch["q"], batch["k_cache"], batch["v_cache"], meta.block_table, meta.seq_lens,
                              max(total), HEAD_DIM ** -0.5, num_splits=num_splits, out=out)
    assert not out.isnan().any()
    assert torch.allclose(out.float().cpu(), reference(host), atol=tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_backend_follows_the_attention_contract(dtype: torch.dtype) -> None:
    host = paged_batch([30, 1, 45], [30, 1, 1], dtype, seed=9)
    batch = on_device(host)
    backend = triton_paged.TritonAttention()
    out = backend.forward(batch["q"], batch["k"], batch["v"], batch["k_cache"], batch["v_cache"],
                          backend.plan(batch["meta"], BLOCK), HEAD_DIM ** -0.5)
    assert torch.allclose(out.float().cpu(), reference(host), atol=tolerance(dtype))
    decode_only = paged_batch([30, 2, 45], [1, 1, 1], dtype, seed=10)
    batch = on_device(decode_only)
    out = backend.forward(batch["q"], batch["k"], batch["v"], batch["k_cache"], batch["v_cache"], batch["meta"],
                          HEAD_DIM ** -0.5)
    assert torch.allclose(out.float().cpu(), reference(decode_only), atol=tolerance(dtype))
