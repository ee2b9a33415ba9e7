"""Triton kernels behind the attention contract (metadata.py), for GPUs.

- `write_kv`: each new token's K and V into its cache slot.
- `paged_attention`: any mix of prefill chunks and decodes in one launch, queries tiled by BLOCK_M,
  keys and values read block by block through the block table, causal mask offset by the cached
  tokens, online softmax in fp32, GQA by mapping each query head to its KV head.
- `paged_decode`: one query per sequence, split over the context (flash-decoding) so that long
  contexts use many programs: each split writes an unnormalised partial with its max and sum, and
  `_combine` merges them.

Both take a layer's sliding window (a runtime argument: one compiled kernel serves every window) and
soft-cap (a compile-time constant, so uncapped layers pay nothing for it), see AttentionBackend. Blocks
wholly before a window are never visited, nor keys before it read, and a windowed decode splits only the
blocks its window spans.

They run on CPU under TRITON_INTERPRET=1 (fp32 and fp16; the interpreter gets bf16 wrong), which is
how the tests check them against the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_core.attention.metadata import AttentionMetadata

NO_WINDOW = 1 << 30  # the kernels' window when a layer has none: further back than any sequence reaches


@triton.jit
def _write_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
              stride_cs, stride_ch, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token)
    d = tl.arange(0, HEAD_DIM_P2)
    mask = (d < HEAD_DIM) & (d * 0 + slot >= 0)  # slot -1: a padding row of a graph-replayed batch writes nothing
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + slot * stride_cs + head * stride_ch + d, k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_cs + head * stride_ch + d, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D] (contiguous). Negative slots are skipped."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _write_kv[(tokens, kv_heads)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                                  v.stride(1), kv_heads * head_dim, head_dim, HEAD_DIM=head_dim,
                                  HEAD_DIM_P2=triton.next_power_of_2(head_dim))


@triton.jit
def _tanh(x):
    """tanh from e^-2|x| <= 1, which cannot overflow (and needs no backend's libdevice)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend_block(q, k, v, visible, scale, m_i, l_i, acc, SOFTCAP: tl.constexpr):
    """One block of keys and values into a running (max, sum, weighted values): the online softmax.
    Rows that have seen no visible key yet keep max -inf, sum 0 and acc 0."""
    s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
    if SOFTCAP > 0:
        s = _tanh(s / SOFTCAP) * SOFTCAP
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _load_kv_block(k_cache_ptr, v_cache_ptr, block_table_ptr, seq, b, lo, hi, kv_head, d, d_ok, stride_bt,
                   stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr):
    """Keys and values of the sequence's b-th block for one KV head at positions lo <= pos < hi (zero
    elsewhere, never read), and their positions."""
    n = tl.arange(0, BLOCK_SIZE)
    block_id = tl.load(block_table_ptr + seq * stride_bt + b)
    k_pos = b * BLOCK_SIZE + n
    offsets = block_id * stride_cb + n[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
    kv_ok = ((k_pos >= lo) & (k_pos < hi))[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=kv_ok, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=kv_ok, other=0.0)
    return k, v, k_pos


@triton.jit
def _paged_attention(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr, cu_q_ptr, scale,
                     window, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, SOFTCAP: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        kv_head = head // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_DIM_P2)
        row_ok = rows < q_len
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q_pos = seq_len - q_len + rows  # each query's position in its sequence
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
        first_q = seq_len - q_len + tile * BLOCK_M
        kv_start = tl.maximum(first_q - window + 1, 0)  # the tile's first query sees back to here
        kv_end = tl.minimum(seq_len, first_q + BLOCK_M)  # its last query this far
        for b in range(kv_start // BLOCK_SIZE, tl.cdiv(kv_end, BLOCK_SIZE)):
            k, v, k_pos = _load_kv_block(k_cache_ptr, v_cache_ptr, block_table_ptr, seq, b, kv_start, kv_end, kv_head,
                                         d, d_ok, stride_bt, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
            visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = _attend_block(q, k, v, visible, scale, m_i, l_i, acc, SOFTCAP)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, scale: float,
                    out: torch.Tensor | None = None, block_m: int = 16, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """q: [T, Hq, D] laid out sequence after sequence (cu_seqlens_q); returns [T, Hq, D]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q) if out is None else out
    grid = (seq_lens.shape[0], num_heads, triton.cdiv(max_seqlen_q, block_m))
    _paged_attention[grid](q, k_cache, v_cache, out, block_table, seq_lens, cu_seqlens_q, scale, window or NO_WINDOW,
                           q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
                           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), GROUP=num_heads // k_cache.shape[2],
                           BLOCK_M=block_m, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
                           HEAD_DIM_P2=max(16, triton.next_power_of_2(head_dim)), SOFTCAP=float(softcap))
    return out


@triton.jit
def _decode_split(q_ptr, k_cache_ptr, v_cache_ptr, acc_ptr, ml_ptr, block_table_ptr, seq_lens_ptr, scale, window,
                  stride_qb, stride_qh, stride_bt, stride_cb, stride_cs, stride_ch, blocks_per_split,
                  GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, SOFTCAP: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_kv_heads = tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + (kv_head * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32)
    kv_start = tl.maximum(seq_len - window, 0)
    first = kv_start // BLOCK_SIZE + split * blocks_per_split  # the splits share the window's blocks
    last = tl.minimum(first + blocks_per_split, tl.cdiv(seq_len, BLOCK_SIZE))
    for b in range(first, last):
        k, v, k_pos = _load_kv_block(k_cache_ptr, v_cache_ptr, block_table_ptr, seq, b, kv_start, seq_len, kv_head,
                                     d, d_ok, stride_bt, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
        visible = (k_pos >= kv_start) & (k_pos < seq_len)
        m_i, l_i, acc = _attend_block(q, k, v, visible[None, :], scale, m_i, l_i, acc, SOFTCAP)
    # partials: acc [B, Hq, S, D], (m, l) [B, Hq, S, 2]
    heads = kv_head * GROUP + g
    base = (seq * num_kv_heads * GROUP + heads) * num_splits + split
    tl.store(acc_ptr + base[:, None] * HEAD_DIM_P2 + d[None, :], acc, mask=g_ok[:, None])
    tl.store(ml_ptr + base * 2, m_i, mask=g_ok)
    tl.store(ml_ptr + base * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _combine(acc_ptr, ml_ptr, out_ptr, stride_ob, stride_oh, num_heads, NUM_SPLITS: tl.constexpr,
             SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    s_ok = s < NUM_SPLITS
    base = (seq * num_heads + head) * NUM_SPLITS + s
    m = tl.load(ml_ptr + base * 2, mask=s_ok, other=float("-inf"))
    sums = tl.load(ml_ptr + base * 2 + 1, mask=s_ok, other=0.0)
    top = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))  # empty splits weigh nothing
    acc = tl.load(acc_ptr + base[:, None] * HEAD_DIM_P2 + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(sums * weight, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, max_seq_len: int, scale: float, num_splits: int | None = None,
                 out: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One query per sequence, q: [B, Hq, D]; the context (with a window, the blocks it spans) split over
    `num_splits` programs per KV head (default: enough to give each split about 256 keys)."""
    batch, num_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // kv_heads
    keys = min(max_seq_len, window) if window else max_seq_len
    # a window of W keys starting anywhere in a block spans at most this many blocks
    max_blocks = min(triton.cdiv(max_seq_len, block_size), triton.cdiv(keys - 1, block_size) + 1)
    if num_splits is None:
        num_splits = max(1, min(16, triton.cdiv(keys, 256)))
    num_splits = min(num_splits, max_blocks)
    blocks_per_split = triton.cdiv(max_blocks, num_splits)
    d_p2 = max(16, triton.next_power_of_2(head_dim))
    acc = torch.empty((batch, num_heads, num_splits, d_p2), dtype=torch.float32, device=q.device)
    ml = torch.empty((batch, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    _decode_split[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, acc, ml, block_table, seq_lens, scale, window or NO_WINDOW, q.stride(0), q.stride(1),
        block_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), blocks_per_split, GROUP=group,
        GROUP_P2=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_P2=d_p2,
        SOFTCAP=float(softcap))
    out = torch.empty_like(q) if out is None else out
    _combine[(batch, num_heads)](acc, ml, out, out.stride(0), out.stride(1), num_heads, NUM_SPLITS=num_splits,
                                 SPLITS_P2=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, HEAD_DIM_P2=d_p2)
    return out


class TritonAttention:
    """The attention contract on Triton kernels: the GPU path. Every tensor of the metadata must be on
    the device; nothing here reads a value back to the host, so a decode step can be graph-captured."""

    name = "triton"
    graph_safe = True

    @staticmethod
    def plan(meta: AttentionMetadata, block_size: int) -> AttentionMetadata:
        return meta  # the kernels take the metadata as it is

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.max_seqlen_q == 1:
            return paged_decode(q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.max_seqlen_k, scale,
                                window=window, softcap=softcap)
        return paged_attention(q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.cu_seqlens_q,
                               meta.max_seqlen_q, scale, window=window, softcap=softcap)
