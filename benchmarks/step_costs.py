"""What the routing benchmark's engine steps cost on this machine, at one thread (as each replica runs): a cold
prefill of a whole prompt, a warm one (the question only, over a cached shared prefix), and a decode step at
batch 1, 2 and 4 with that context. The ratio of a cold prefill to a decode step is what prefix-aware routing
can save per request, so it sets how far `prefix` can get ahead of round robin in `replica_routing.py`.

--linear picks the bf16 linear layers' path: `auto` (the engine's choice for this CPU), `kernel` (the
compiled `linear_bf16`, where this CPU can run it) or both, one after the other.

    .venv/bin/python benchmarks/step_costs.py --linear auto kernel
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest.mock import patch

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_vs_vllm import describe_cpu  # noqa: E402
from engine_core import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_core.loader import resolve_model_dir  # noqa: E402


def timed_step(engine: LLMEngine) -> float:
    started = time.perf_counter()
    engine.step()
    return 1e3 * (time.perf_counter() - started)


def drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def measure(linear: str, prefix_len: int, question_len: int, repeats: int) -> dict[str, float]:
    # --linear kernel: the compiled kernel even where the engine would take oneDNN
    forced = patch("engine_core.models.decoder.linear_kernels", lambda k: k) if linear == "kernel" else nullcontext()
    with forced:
        engine = LLMEngine(EngineConfig(model=str(resolve_model_dir("embedded")), dtype="bfloat16", num_blocks=512,
                                        max_num_seqs=16, enable_prefix_caching=True, num_threads=1))
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40_000) for _ in range(n)]

    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.add_request("warm-up", tokens(64), one)
    drain(engine)
    cold, warm = [], []
    for i in range(repeats):
        prefix = tokens(prefix_len)
        engine.add_request(f"cold{i}", prefix + tokens(question_len), one)
        cold.append(timed_step(engine))
        drain(engine)
        engine.add_request(f"warm{i}", prefix + tokens(question_len), one)
        warm.append(timed_step(engine))
        drain(engine)
    figures = {"path": engine.model.lm_head.path, "cold_prefill_ms": statistics.median(cold),
               "warm_prefill_ms": statistics.median(warm)}
    for batch in (1, 2, 4):
        decode = SamplingParams(max_new_tokens=8 + batch + 20, ignore_eos=True)
        for j in range(batch):
            engine.add_request(f"decode{batch}-{j}", tokens(prefix_len + question_len), decode)
        for _ in range(batch + 3):  # the prefills and a few decode steps first
            engine.step()
        figures[f"decode_b{batch}_ms"] = statistics.median(timed_step(engine) for _ in range(15))
        drain(engine)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--linear", nargs="+", choices=["auto", "kernel"], default=["auto"])
    parser.add_argument("--prefix-len", type=int, default=614)
    parser.add_argument("--question-len", type=int, default=51)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(describe_cpu(), flush=True)
    for linear in args.linear:
        f = measure(linear, args.prefix_len, args.question_len, args.repeats)
        total = args.prefix_len + args.question_len
        print(f"--linear {linear} ({f['path']}), one thread: cold {total}-token prefill {f['cold_prefill_ms']:.0f} ms, "
              f"warm prefill of {args.question_len} over {args.prefix_len} cached {f['warm_prefill_ms']:.0f} ms; "
              f"decode at ~{total} tokens, batch 1/2/4: {f['decode_b1_ms']:.1f} / {f['decode_b2_ms']:.1f} / "
              f"{f['decode_b4_ms']:.1f} ms; a cold prefill costs {f['cold_prefill_ms'] / f['decode_b2_ms']:.0f} "
              f"batch-2 decode steps", flush=True)


if __name__ == "__main__":
    main()
