"""Sliding-window attention and attention-logit soft-capping (Mistral, Qwen2, Gemma 2 and 3) through every
attention backend: the torch reference, the compiled CPU kernel of each ISA build this CPU can run, and the
Triton kernels (in Triton's interpreter on CPU, see conftest), against dense attention written here in
plain torch. Head sizes 64, 128 and 256, fp32 and bf16, GQA, block size 16, random block tables."""

from __future__ import annotations

import pytest
import torch

from engine_core.attention import AttentionBackend, AttentionMetadata, TorchReferenceAttention
from engine_core.attention.cpu_paged import CpuPagedAttention
from tests.kernel_helpers import kernels_for

ISAS = ["avx512_bf16", "avx512", "avx2", "scalar"]  # every build; those this CPU cannot run are skipped
BACKENDS = ["torch", *ISAS, "triton"]
HEADS, KV_HEADS, BLOCK, NUM_BLOCKS = 4, 2, 16, 40
WINDOW = 21  # shorter than every sequence of the mixed step, not a multiple of BLOCK
SOFTCAP = 5.0
Q_GAIN = 3.0  # queries scaled up so that scores reach the cap: q·k * scale ~ N(0, 9)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchReferenceAttention()
    if name == "triton":
        triton_paged = pytest.importorskip("engine_core.attention.triton_paged", reason="triton is not installed")
        return triton_paged.TritonAttention()
    return CpuPagedAttention(kernels_for(name).paged_decode)


def kernel_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """Triton's interpreter gets bf16 wrong: there, fp16 stands in for it (a GPU runs bf16 itself)."""
    return torch.float16 if name == "triton" and DEVICE == "cpu" and dtype == torch.bfloat16 else dtype


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
          softcap: float = 0.0) -> torch.Tensor:
    """The last len(q) positions of one sequence ([n, Hq, D]) over all its keys and values ([L, Hkv, D]),
    in float64: scores soft-capped, then masked causally and to the window, then softmax."""
    n, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(length - n, length).unsqueeze(1)
    k_pos = torch.arange(length).unsqueeze(0)
    visible = k_pos <= q_pos
    if window:
        visible &= k_pos > q_pos - window
    return torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def paged_step(total: list[int], new: list[int], head_dim: int, dtype: torch.dtype, seed: int, poison: float,
               gain: float = Q_GAIN) -> dict:
    """One engine step over sequences of `total` tokens, the last `new` of each computed now: earlier tokens
    are already in the cache at random blocks, every slot no sequence owns holds `poison`. Queries are
    scaled by `gain`."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    k_cache = torch.full((NUM_BLOCKS, BLOCK, KV_HEADS, head_dim), poison, dtype=dtype)
    v_cache = torch.full_like(k_cache, poison)
    tables, slots, seqs = [], [], []
    for n, m in zip(total, new):
        table = [order.pop() for _ in range(-(-n // BLOCK))]
        q = (torch.randn(m, HEADS, head_dim, generator=gen) * gain).to(dtype)
        k = torch.randn(n, KV_HEADS, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, KV_HEADS, head_dim, generator=gen).to(dtype)
        for pos in range(n - m):
            k_cache[table[pos // BLOCK], pos % BLOCK] = k[pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = v[pos]
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n - m, n)]
        tables.append(table)
        seqs.append((q, k, v))
    width = max(len(t) for t in tables)
    cu = torch.tensor([0, *new]).cumsum(0).int()
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE), cu_seqlens_q=cu.to(DEVICE),
        seq_lens=torch.tensor(total, dtype=torch.int32, device=DEVICE),
        block_table=torch.tensor([t + [order[0]] * (width - len(t)) for t in tables], dtype=torch.int32,
                                 device=DEVICE),  # padding points at an unowned block
        max_seqlen_q=max(new), max_seqlen_k=max(total), query_lens=list(new), seq_lens_host=list(total))
    step = {"q": torch.cat([q for q, _, _ in seqs]), "k": torch.cat([k[n - m:] for (_, k, _), n, m in
                                                                      zip(seqs, total, new)]),
            "v": torch.cat([v[n - m:] for (_, _, v), n, m in zip(seqs, total, new)]),
            "k_cache": k_cache, "v_cache": v_cache}
    return {**{name: t.to(DEVICE) for name, t in step.items()}, "meta": meta, "seqs": seqs}


def poison_for(name: str) -> float:
    """NaN for the kernels, which must not read a slot they have no business with; the torch reference
    gathers whole (padded) blocks and masks, so it gets large finite junk instead."""
    return 1e4 if name == "torch" else float("nan")


@pytest.mark.parametrize("softcap", [0.0, SOFTCAP])
@pytest.mark.parametrize("window", [0, WINDOW])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name", BACKENDS)
def test_mixed_step_matches_dense_attention(name: str, head_dim: int, dtype: torch.dtype, window: int,
                                            softcap: float) -> None:
    """A chunk over a cached prefix whose window starts inside the prefix, a fresh prefill longer than the
    window, two decodes whose windows start mid-block; 4 query heads over 2 KV heads."""
    backend, dtype = backend_for(name), kernel_dtype(name, dtype)
    total, new = [40, 30, 38, 50], [13, 30, 1, 1]
    step = paged_step(total, new, head_dim, dtype, seed=head_dim + window, poison=poison_for(name))
    scale = head_dim ** -0.5
    meta = step["meta"]
    out = backend.forward(step["q"], step["k"], step["v"], step["k_cache"], step["v_cache"],
                          backend.plan(meta, BLOCK), scale, window=window, softcap=softcap).cpu()
    assert not out.isnan().any()
    start = 0
    for (q, k, v), m in zip(step["seqs"], new):
        want = dense(q, k, v, scale, window, softcap)
        got = out[start:start + m].double()
        assert torch.allclose(got, want, atol=tolerance(dtype)), (m, (got - want).abs().max())
        if window or softcap:  # and each matters here: without it the answer is far off
            assert (dense(q, k, v, scale) - want).abs().max() > 10 * tolerance(dtype)
        start += m


LONG = [300, 77, 40, 9]  # decodes: far past the window, past it, exactly it, within it
LONG_WINDOW = 40


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", BACKENDS)
def test_long_decode_sees_only_its_last_window_of_keys(name: str, dtype: torch.dtype) -> None:
    """Decoding at 300 keys with a window of 40 equals dense attention over the last 40 keys alone. Every
    key before the window is poisoned (NaN for the kernels: reading one at all shows up)."""
    backend, dtype = backend_for(name), kernel_dtype(name, dtype)
    head_dim, scale = 128, 128 ** -0.5
    step = paged_step(LONG, [1] * len(LONG), head_dim, dtype, seed=7, poison=poison_for(name), gain=1.0)
    table = step["meta"].block_table.cpu()
    for i, n in enumerate(LONG):
        for pos in range(max(0, n - LONG_WINDOW)):
            for cache in (step["k_cache"], step["v_cache"]):
                cache[table[i, pos // BLOCK], pos % BLOCK] = poison_for(name)
    out = backend.forward(step["q"], step["k"], step["v"], step["k_cache"], step["v_cache"],
                          backend.plan(step["meta"], BLOCK), scale, window=LONG_WINDOW).cpu()
    for i, ((q, k, v), n) in enumerate(zip(step["seqs"], LONG)):
        want = dense(q, k[-LONG_WINDOW:], v[-LONG_WINDOW:], scale)
        assert torch.allclose(out[i:i + 1].double(), want, atol=tolerance(dtype)), n


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_split_decode_shares_out_the_window(num_splits: int) -> None:
    """The split decode divides only the blocks a window spans: 3 splits over its at most 4 blocks leave
    some empty, which must weigh nothing in the combine."""
    triton_paged = pytest.importorskip("engine_core.attention.triton_paged", reason="triton is not installed")
    head_dim, scale = 64, 64 ** -0.5
    step = paged_step(LONG, [1] * len(LONG), head_dim, torch.float32, seed=3, poison=float("nan"))
    meta = step["meta"]
    triton_paged.write_kv(step["k"], step["v"], step["k_cache"], step["v_cache"], meta.slot_mapping)
    out = triton_paged.paged_decode(step["q"], step["k_cache"], step["v_cache"], meta.block_table, meta.seq_lens,
                                    max(LONG), scale, num_splits=num_splits, window=LONG_WINDOW,
                                    softcap=SOFTCAP).cpu()
    for i, (q, k, v) in enumerate(step["seqs"]):
        want = dense(q, k, v, scale, LONG_WINDOW, SOFTCAP)
        assert torch.allclose(out[i:i + 1].double(), want, atol=tolerance(torch.float32)), LONG[i]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_cpu_kernel_generic_head_size_takes_window_and_softcap(isa: str, dtype: torch.dtype) -> None:
    """A head size no vectorised path is compiled for (80) goes through the generic one, window and cap
    included."""
    backend = backend_for(isa)
    head_dim, scale = 80, 80 ** -0.5
    total, new = [40, 30, 38], [13, 30, 1]
    step = paged_step(total, new, head_dim, dtype, seed=11, poison=float("nan"))
    out = backend.forward(step["q"], step["k"], step["v"], step["k_cache"], step["v_cache"], step["meta"], scale,
                          window=WINDOW, softcap=SOFTCAP)
    start = 0
    for (q, k, v), m in zip(step["seqs"], new):
        want = dense(q, k, v, scale, WINDOW, SOFTCAP)
        assert torch.allclose(out[start:start + m].double(), want, atol=tolerance(dtype)), m
        start += m


SPANS = [600, 255, 1, 512, 513, 40, 1100, 9, 700]  # keys a row sees: the bf16 kernel splits more than 512
# the kernels that split a row's keys into spans: bf16 (spans of up to 512 keys) and the AVX2 build's fp32 (up to
# 64 KiB of a KV head's keys: 256 keys of 64 dimensions, 64 of 256)
SPLITTING = [("avx512_bf16", torch.bfloat16), ("avx2", torch.float32)]


@pytest.mark.parametrize(("isa", "dtype"), SPLITTING)
@pytest.mark.parametrize("rows", [4, 9])  # fewer rows than 4 per thread: a task per KV head; more: whole rows
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (700, SOFTCAP)])  # 1,100 keys: a window of 2 spans
def test_long_rows_in_key_spans_match_dense_attention_and_give_a_row_alone_its_bits(
        rows: int, window: int, softcap: float, isa: str, dtype: torch.dtype) -> None:
    """The bf16 and AVX2 fp32 kernels split a long row's keys into even spans (one long sequence keeps both threads
    busy) and merge the spans' softmax partials: each row matches dense attention, window and cap included, and gets
    exactly the output it gets alone, as a 1-row decode step, whatever else its step holds (exact speculation)."""
    paged_decode = kernels_for(isa).paged_decode
    head_dim, scale, lens = 64, 64 ** -0.5, SPANS[:rows]
    gen = torch.Generator().manual_seed(5)
    blocks = sum(-(-n // BLOCK) for n in lens) + 1
    k_cache = torch.full((blocks, BLOCK, KV_HEADS, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(blocks, generator=gen).tolist()
    tables, seqs = [], []
    for n in lens:
        table = [order.pop() for _ in range(-(-n // BLOCK))]
        k = torch.randn(n, KV_HEADS, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, KV_HEADS, head_dim, generator=gen).to(dtype)
        for pos in range(n):
            k_cache[table[pos // BLOCK], pos % BLOCK] = k[pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = v[pos]
        tables.append(table)
        seqs.append((k, v))
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [order[0]] * (width - len(t)) for t in tables])  # padding: the unowned block
    q = (torch.randn(rows, HEADS, head_dim, generator=gen) * Q_GAIN).to(dtype)
    counts = torch.tensor(lens)
    out = paged_decode(q, k_cache, v_cache, table, counts, scale, window, softcap)
    for i, (k, v) in enumerate(seqs):
        want = dense(q[i:i + 1], k, v, scale, window, softcap)
        assert torch.allclose(out[i:i + 1].double(), want, atol=tolerance(dtype)), lens[i]
        alone = paged_decode(q[i:i + 1], k_cache, v_cache, table[i:i + 1], counts[i:i + 1], scale, window, softcap)
        assert torch.equal(alone[0], out[i]), lens[i]


@pytest.mark.parametrize(("isa", "dtype"), SPLITTING)
@pytest.mark.parametrize(("group", "kv_heads", "head_dim"), [(3, 3, 64), (4, 1, 256)])  # SmolLM2, Gemma 3 270M
@pytest.mark.parametrize("last", [40, 515, 1030])  # the pass's last key: one span, across 512, two spans at 1,024
def test_a_verify_pass_scores_each_position_as_a_one_row_step_does(group: int, kv_heads: int, head_dim: int,
                                                                    last: int, isa: str, dtype: torch.dtype) -> None:
    """A speculative verify pass of 1 + 5 rows is one sequence's last six positions: each row must get, to the bit,
    what a 1-row decode step at that position gets, or greedy output would change with drafts on. The rows straddle a
    16-key tile and, at 515 keys, the 512 keys where a bf16 row starts to split into spans (fp32 rows split sooner:
    the rows of 515 and 1,030 keys straddle a change in their span count)."""
    paged_decode = kernels_for(isa).paged_decode
    rows, heads, scale = 6, group * kv_heads, head_dim ** -0.5
    gen = torch.Generator().manual_seed(last)
    blocks = -(-last // BLOCK)
    k_cache = torch.randn(blocks + 1, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks + 1, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(blocks + 1, generator=gen)[:blocks].view(1, -1).expand(rows, -1).contiguous()
    q = (torch.randn(rows, heads, head_dim, generator=gen) * Q_GAIN).to(dtype)
    counts = torch.arange(last - rows + 1, last + 1)
    out = paged_decode(q, k_cache, v_cache, table, counts, scale, 0, 0.0)
    k = torch.stack([k_cache[table[0, p // BLOCK], p % BLOCK] for p in range(last)])
    v = torch.stack([v_cache[table[0, p // BLOCK], p % BLOCK] for p in range(last)])
    assert torch.allclose(out.double(), dense(q, k, v, scale), atol=tolerance(dtype))  # causal per row
    for i in range(rows):
        alone = paged_decode(q[i:i + 1], k_cache, v_cache, table[i:i + 1], counts[i:i + 1], scale, 0, 0.0)
        assert torch.equal(alone[0], out[i]), f"position {int(counts[i])}"
