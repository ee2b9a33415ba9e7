"""GPU microbenchmark of the Triton paged-decode kernel: achieved GB/s against the bytes it must read
(every key and value of every sequence once), next to a device-to-device copy measured in the same run.

    python benchmarks/gpu_kernels.py            # needs CUDA
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_core.attention.triton_paged import paged_attention, paged_decode  # noqa: E402


def timed(fn, repeats: int = 20) -> float:  # noqa: ANN001
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / 1000  # seconds


def main() -> None:
    assert torch.cuda.is_available(), "needs CUDA"
    print(f"device: {torch.cuda.get_device_name()}")
    copy_src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_gbs = 2 * copy_src.numel() / timed(lambda: copy_dst.copy_(copy_src)) / 1e9  # read + write
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    print("| batch | context | heads q/kv | head dim | splits | time (us) | bytes read (MB) | GB/s | of copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in ((1, 4096, 32, 8, 128), (64, 2048, 32, 8, 128), (256, 1024, 32, 8, 128), (64, 2048, 9, 3, 64)):
        measure(*case, copy_gbs=copy_gbs)


def measure(batch: int, context: int, heads: int, kv_heads: int, dim: int, copy_gbs: float, block: int = 16) -> None:
    blocks_per_seq = context // block
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks, device="cuda", dtype=torch.int64).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    read = 2 * batch * context * kv_heads * dim * 2  # keys and values, bf16
    runs = {"1": lambda: paged_decode(q, k_cache, v_cache, table, seq_lens, context, dim ** -0.5, num_splits=1),
            "auto": lambda: paged_decode(q, k_cache, v_cache, table, seq_lens, context, dim ** -0.5),
            "mixed kernel": lambda: paged_attention(q, k_cache, v_cache, table, seq_lens, cu, 1, dim ** -0.5)}
    for label, run in runs.items():
        seconds = timed(run)
        gbs = read / seconds / 1e9
        print(f"| {batch} | {context} | {heads}/{kv_heads} | {dim} | {label} | {seconds * 1e6:.0f} "
              f"| {read / 1e6:.0f} | {gbs:.0f} | {gbs / copy_gbs:.0%} |")

if __name__ == "__main__":
    main()
