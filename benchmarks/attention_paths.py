"""One layer's decode attention through each CPU path: the torch reference against the compiled paged
kernel of each ISA build this CPU can run, in fp32 and bf16, interleaved, best of N (the machine is
shared: ratios within one run are what count).

    .venv/bin/python benchmarks/attention_paths.py
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/attention_paths.py --isa avx2   # torch on AVX2 too
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_core.attention import AttentionBackend, AttentionMetadata, TorchReferenceAttention  # noqa: E402
from engine_core.attention.cpu_paged import CpuPagedAttention  # noqa: E402
from engine_core.cpu.features import cpu_features  # noqa: E402
from engine_core.cpu.kernels import build_for_isa  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M's attention


def decode_case(batch: int, context: int, dtype: torch.dtype) -> tuple:
    blocks_per_seq = -(-context // BLOCK)
    k_cache = torch.randn(batch * blocks_per_seq + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(1, batch * blocks_per_seq + 1).view(batch, -1).int()
    last = context - 1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([int(tables[b, last // BLOCK]) * BLOCK + last % BLOCK for b in range(batch)]),
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32), seq_lens=torch.full((batch,), context,
                                                                                      dtype=torch.int32),
        block_table=tables, max_seqlen_q=1, max_seqlen_k=context, query_lens=[1] * batch,
        seq_lens_host=[context] * batch)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype)
    k, v = torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=dtype), torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=dtype)
    return q, k, v, k_cache, v_cache, meta


def best_ms(paths: dict[str, AttentionBackend], case: tuple, rounds: int, calls: int = 5) -> dict[str, float]:
    q, k, v, k_cache, v_cache, meta = case
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, attention in paths.items():
            plan = attention.plan(meta, BLOCK) if isinstance(attention, CpuPagedAttention) else meta
            started = time.perf_counter()
            for _ in range(calls):
                attention.forward(q, k, v, k_cache, v_cache, plan, HEAD_DIM ** -0.5)
            times[name].append((time.perf_counter() - started) / calls * 1e3)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--isa", nargs="+", default=["avx512_bf16", "avx2"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_features().describe()}; torch's own kernels: {torch.backends.cpu.get_cpu_capability()}")
    paths: dict[str, AttentionBackend] = {"torch": TorchReferenceAttention()}
    for isa in args.isa:
        build = build_for_isa(isa)
        if build is not None:
            paths[f"kernel-{isa}"] = CpuPagedAttention(build.module.paged_decode)
    print(f"{'dtype':<9} {'batch':>5} {'ctx':>5} " + " ".join(f"{n:>18}" for n in paths) + "   (ms per layer call)")
    for dtype in (torch.float32, torch.bfloat16):
        for batch, context in ((1, 300), (32, 300), (128, 300)):
            got = best_ms(paths, decode_case(batch, context, dtype), args.rounds)
            ref = got["torch"]
            print(f"{str(dtype)[6:]:<9} {batch:>5} {context:>5} "
                  + " ".join(f"{ms:>8.3f} ({ref / ms:>4.1f}x)" for ms in got.values()), flush=True)


if __name__ == "__main__":
    main()
