"""Engine output tok/s with LoRA adapters: no adapter, 1 adapter, and 4 adapters mixed across requests.

Same engine, same run, same prompts: c requests with random ~100-token prompts and 128 new tokens
(ignore_eos) go in at once; throughput = output tokens / wall time. The adapters are made here with
peft (random nonzero A and B, fixed seeds, all seven projections). Each mode runs `--repeats` times,
interleaved with the others so a neighbour's load on a shared machine hits all modes alike; the
median is reported. Target: 4 mixed >= 0.8x the base model.

    .venv/bin/python benchmarks/lora_throughput.py --concurrency 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_throughput import random_prompts  # noqa: E402
from engine_core import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_core.cpu.features import cpu_features  # noqa: E402
from engine_core.loader import resolve_model_dir  # noqa: E402
from tests.lora_helpers import make_adapter  # noqa: E402


def run(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], output_len: int) -> float:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", prompt, SamplingParams(max_new_tokens=output_len, ignore_eos=True,
                                                           adapter=adapters[i % len(adapters)]))
    generated = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        generated += len(engine.step())
    return generated / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    model_dir = resolve_model_dir("embedded")
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        paths = {f"a{i}": str(make_adapter(model_dir, Path(tmp) / f"a{i}", seed=i, rank=args.rank, scale=0.5))
                 for i in range(4)}
        config = EngineConfig(model=str(model_dir), dtype=args.dtype, max_num_seqs=args.concurrency,
                              max_num_batched_tokens=2048, kv_cache_bytes=2 * 1024**3, lora_adapters=paths,
                              max_loras=4, max_lora_rank=args.rank)
        engine = LLMEngine(config)
    print(f"CPU: {cpu_features().describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"dtype {str(engine.model.dtype).removeprefix('torch.')}; layer ops {type(engine.model.ops).__name__}, "
          f"attention {engine.model.attention.name}", flush=True)
    modes: dict[str, list[str | None]] = {"no adapter": [None], "1 adapter": ["a0"],
                                          "4 adapters mixed": ["a0", "a1", "a2", "a3"]}
    run(engine, random_prompts(4, args.prompt_len, 49152, seed=99), ["a0", None, "a1", "a2"], 4)  # warm-up
    prompts = random_prompts(args.concurrency, args.prompt_len, 49152, seed=args.concurrency)
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode, names in modes.items():
            samples[mode].append(run(engine, prompts, names, args.output_len))
            print(f"  {mode}: {samples[mode][-1]:.1f} tok/s", flush=True)
    base = statistics.median(samples["no adapter"])
    results = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_features().describe(), "concurrency": args.concurrency,
               "rank": args.rank, "dtype": str(engine.model.dtype).removeprefix("torch."), "tok_per_s": {}}
    for mode in modes:
        median = statistics.median(samples[mode])
        results["tok_per_s"][mode] = median
        print(f"c={args.concurrency} {mode}: {median:.1f} tok/s (median of {args.repeats}) = {median / base:.2f}x base")
    assert engine.block_manager.check_all_free()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
