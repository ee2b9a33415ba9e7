"""The torch reference attention over the paged cache against plain dense causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_core.attention import AttentionBackend, AttentionMetadata, TorchReferenceAttention
from engine_core.attention.cpu_paged import CpuPagedAttention
from engine_core.attention.torch_ref import _grouped_decode
from tests.kernel_helpers import ISAS, kernels_for

# The compiled kernels of both kinds of machine the engine runs on: AVX-512 BF16 and AVX2 only (ISAS). A
# CPU runs the builds for its own ISA and below; the others are skipped, with the reason.


def kernel_for(isa: str):  # type: ignore[no-untyped-def]
    return kernels_for(isa).paged_decode


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over one whole sequence, [T, H, D], in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    causal = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(k.shape[0] - q.shape[0])
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("path", ["torch", *ISAS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 64])  # the kernel's generic path, and its vectorised one
def test_mixed_prefill_and_decode_batch_matches_dense_attention(dtype: torch.dtype, dim: int, path: str) -> None:
    backend: AttentionBackend = TorchReferenceAttention() if path == "torch" else CpuPagedAttention(kernel_for(path))
    torch.manual_seed(0)
    heads, kv_heads, block = 6, 2, 4
    total = [7, 1, 12, 5]  # tokens each sequence has in all
    new = [7, 1, 3, 1]  # computed this step: a prefill, two decodes, a chunk over a cached prefix
    qkv = [(torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)) for n in total]
    cache_k = torch.zeros(32, block, kv_heads, dim, dtype=dtype)
    cache_v = torch.zeros_like(cache_k)
    tables, next_block = [], 1
    for n in total:
        blocks = -(-n // block)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    # what earlier steps wrote: every token before this step's new ones
    for (_, k, v), table, n, m in zip(qkv, tables, total, new):
        for pos in range(n - m):
            cache_k[table[pos // block], pos % block] = k[pos].to(dtype)
            cache_v[table[pos // block], pos % block] = v[pos].to(dtype)
    q_in = torch.cat([q[n - m:] for (q, _, _), n, m in zip(qkv, total, new)]).to(dtype)
    k_in = torch.cat([k[n - m:] for (_, k, _), n, m in zip(qkv, total, new)]).to(dtype)
    v_in = torch.cat([v[n - m:] for (_, _, v), n, m in zip(qkv, total, new)]).to(dtype)
    slots = [table[p // block] * block + p % block for table, n, m in zip(tables, total, new) for p in range(n - m, n)]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.tensor([0, 7, 8, 11, 12], dtype=torch.int32),
        seq_lens=torch.tensor(total, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_seqlen_q=7, max_seqlen_k=12, query_lens=new, seq_lens_host=total)
    out = backend.forward(q_in, k_in, v_in, cache_k, cache_v, meta, dim ** -0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    start = 0
    for (q, k, v), n, m in zip(qkv, total, new):
        want = dense_reference(q.to(dtype), k.to(dtype), v.to(dtype), dim ** -0.5)[n - m:]
        assert torch.allclose(out[start:start + m].double(), want, atol=tolerance), (n, m)
        start += m


def test_grouped_decode_equals_sdpa_with_gqa_and_mask() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(5, 9, 64), torch.randn(5, 3, 40, 64), torch.randn(5, 3, 40, 64)
    mask = torch.arange(40)[None] < torch.tensor([40, 1, 17, 33, 8])[:, None]
    want = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=0.125,
                                          enable_gqa=True).squeeze(2)
    assert torch.allclose(_grouped_decode(q, k, v, mask, 0.125), want, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])  # 64, 128, 256 take the vectorised paths, 16 the generic
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [3, 4, 5])  # bf16 has kernels for groups 1-4 and 8; 5 takes the fallback
@pytest.mark.parametrize("isa", ISAS)
def test_cpu_paged_decode_kernel_reads_only_its_own_blocks(dtype: torch.dtype, head_dim: int, group: int,
                                                           isa: str) -> None:
    """Random block tables, ragged lengths, GQA, and a cache poisoned with NaN everywhere no sequence
    owns: any read outside a sequence's blocks and length shows up as NaN."""
    kernel = kernel_for(isa)
    torch.manual_seed(head_dim)
    kv_heads, block, num_blocks = 2, 4, 64
    heads = group * kv_heads
    lens = [1, 5, 4, 17, 9, 30, 16, 33]  # tails of 16-key tiles of every kind
    cache_k = torch.full((num_blocks, block, kv_heads, head_dim), float("nan"), dtype=dtype)
    cache_v = torch.full_like(cache_k, float("nan"))
    order = torch.randperm(num_blocks).tolist()
    tables, keys, values = [], [], []
    for n in lens:
        blocks = [order.pop() for _ in range(-(-n // block))]
        k, v = torch.randn(n, kv_heads, head_dim, dtype=dtype), torch.randn(n, kv_heads, head_dim, dtype=dtype)
        for pos in range(n):
            cache_k[blocks[pos // block], pos % block] = k[pos]
            cache_v[blocks[pos // block], pos % block] = v[pos]
        tables.append(blocks)
        keys.append(k)
        values.append(v)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [order[0]] * (width - len(t)) for t in tables])  # padding points at a poisoned block
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    out = kernel(q, cache_k, cache_v, table, torch.tensor(lens), head_dim ** -0.5)
    assert not out.isnan().any()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lens):
        want = dense_reference(q[i:i + 1].float(), keys[i].float(), values[i].float(), head_dim ** -0.5)[0]
        assert torch.allclose(out[i].double(), want, atol=tolerance), (i, n)
