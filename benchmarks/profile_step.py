"""Where a decode step's time goes: the engine with B sequences all decoding, timed by phase
(prepare, forward, logits, sample, postprocess) and profiled by op with torch.profiler.

    .venv/bin/python benchmarks/profile_step.py --batch 1 32 128 --dtype bfloat16 --threads 2
    # what the fused layer ops buy: their steps against torch ops', alternating, in one run; on an AVX2 CPU's path:
    LLMGW_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/profile_step.py \
        --dtype float32 --compare-ops
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import random_prompts  # noqa: E402
from engine_core import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_core.cpu.features import cpu_features  # noqa: E402
from engine_core.loader import resolve_model_dir  # noqa: E402
from engine_core.models.layers.layer_ops import TorchLayerOps  # noqa: E402


def decode_steps(engine: LLMEngine, batch: int, steps: int, prompt_len: int) -> dict[str, float]:
    params = SamplingParams(max_new_tokens=10_000, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, 49152, seed=batch)):
        engine.add_request(f"p{batch}-{i}", prompt, params)
    scheduler = engine.scheduler
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in [*scheduler.running, *scheduler.waiting]):
        engine.step()
    for _ in range(3):
        engine.step()  # warm
    phases: dict[str, list[float]] = {k: [] for k in ("schedule", "prepare", "forward", "logits", "sample", "post")}
    runner = engine.runner
    for _ in range(steps):
        t0 = time.perf_counter()
        sched = engine.scheduler.schedule()
        t1 = time.perf_counter()
        prepared = runner.prepare(sched)
        t2 = time.perf_counter()
        # as the runner steps without drafts: quantized matmuls may round from ROUNDED_MIN_ROWS rows
        hidden = runner.model.forward(prepared.input_ids, prepared.positions, prepared.meta, exact=False)
        t3 = time.perf_counter()
        logits = runner.model.compute_logits(hidden[prepared.sample_rows], exact=False)
        t4 = time.perf_counter()
        result = runner.sampler(logits, prepared.sample_seqs)
        t5 = time.perf_counter()
        engine.postprocess(sched, prepared.sample_seqs, result)
        t6 = time.perf_counter()
        for key, a, b in (("schedule", t0, t1), ("prepare", t1, t2), ("forward", t2, t3), ("logits", t3, t4),
                          ("sample", t4, t5), ("post", t5, t6)):
            phases[key].append(1000 * (b - a))
    for seq in list(engine.scheduler.running):
        engine.abort(seq.request_id)
    return {k: statistics.median(v) for k, v in phases.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=160)
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler's top ops")
    parser.add_argument("--compare-ops", action="store_true",
                        help="time steps with the model's layer ops and with torch ops, alternating")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=str(resolve_model_dir("embedded")), dtype=args.dtype,
                                    max_num_seqs=max(args.batch), kv_cache_bytes=2 * 1024**3,
                                    num_threads=args.threads))
    print(f"CPU: {cpu_features().describe()}; torch threads: {torch.get_num_threads()}, dtype {args.dtype}, "
          f"layer ops {type(engine.model.ops).__name__}, attention {engine.model.attention.name}")
    if args.compare_ops:
        compare_ops(engine, args)
        return
    for batch in args.batch:
        phases = decode_steps(engine, batch, args.steps, args.prompt_len)
        total = sum(phases.values())
        print(f"batch {batch}: step {total:.1f} ms = " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
              + f"  -> {1000 * batch / total:.0f} tok/s")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                decode_steps(engine, batch, 5, args.prompt_len)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def compare_ops(engine: LLMEngine, args: argparse.Namespace) -> None:
    """The median step with the model's own layer ops and with torch ops, 3 rounds alternating; best of each."""
    model = engine.model
    own, reference = model.ops, TorchLayerOps(model.args.rms_norm_eps)
    for batch in args.batch:
        best = {"model": float("inf"), "torch": float("inf")}
        for _ in range(3):
            for name, ops in (("model", own), ("torch", reference)):
                model.ops = ops
                best[name] = min(best[name], sum(decode_steps(engine, batch, args.steps, args.prompt_len).values()))
        model.ops = own
        print(f"batch {batch}: step {best['model']:.2f} ms with {type(own).__name__}, {best['torch']:.2f} ms with "
              f"TorchLayerOps: {best['torch'] / best['model']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
