"""What a speculative verify pass costs: one request decoding a code prompt with n-gram drafts, each step's
time grouped by the rows it computed (1: a plain decode step, 1 + k: a verify pass with k drafts).

    .venv/bin/python benchmarks/verify_cost.py                      # the embedded model as shipped (Q4_1)
    .venv/bin/python benchmarks/verify_cost.py --quantization none  # bf16 weights
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_vs_vllm import describe_cpu  # noqa: E402
from engine_core import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_core.spec_decode import SpeculativeConfig  # noqa: E402

CODE = "\n".join(f"def f{i}(x, y):\n    total = x + y * {i}\n    return total" for i in range(20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--drafts", type=int, nargs="+", default=[3, 5, 7], help="num_speculative_tokens to run")
    parser.add_argument("--tokens", type=int, default=200, help="output tokens per request")
    args = parser.parse_args()
    print(describe_cpu(), flush=True)
    times: dict[int, list[float]] = defaultdict(list)
    for k in args.drafts:
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=5)
        engine = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization, speculative=spec))
        prompt = engine.tokenize("Repeat this code:\n" + CODE + "\n" + CODE[:50])
        for rep in range(3):
            engine.add_request(f"r{rep}", prompt, SamplingParams(max_new_tokens=args.tokens, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
                step = engine.last_step
                if step is not None and step.num_tokens <= 1 + k:  # decode and verify steps, not the prefill
                    times[step.num_tokens].append(step.seconds * 1000)
    one = statistics.median(times[1]) if times.get(1) else None
    print("| rows in the step | steps | median ms | x one row |\n|---:|---:|---:|---:|")
    for rows in sorted(times):
        median = statistics.median(times[rows])
        print(f"| {rows} | {len(times[rows])} | {median:.1f} | {median / one:.2f}x |" if one else
              f"| {rows} | {len(times[rows])} | {median:.1f} | - |")


if __name__ == "__main__":
    main()
