"""Engine throughput vs transformers' sequential generate, same model, same run.

N requests with random ~100-token prompts and 128 new tokens (ignore_eos) go into the engine at
once; the reference runs `model.generate` on a few of the same prompts one after another.
Throughput = output tokens / wall time.

    .venv/bin/python benchmarks/engine_throughput.py --concurrency 32 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_core import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_core.loader import resolve_model_dir  # noqa: E402


def random_prompts(n: int, mean_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(mean_len * 0.8), int(mean_len * 1.2) + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (n_,), generator=g).tolist() for n_ in lengths]


def run_engine(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    first_token: dict[str, float] = {}
    started = time.perf_counter()
    generated = 0
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            generated += 1
            first_token.setdefault(o.request_id, now - started)
    wall = time.perf_counter() - started
    return {"output_tokens": generated, "seconds": wall, "tok_per_s": generated / wall, "steps": steps,
            "ttft_p50_s": statistics.median(first_token.values())}


def run_hf(model_dir: Path, prompts: list[list[int]], output_len: int, dtype: torch.dtype,
           device: torch.device) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    generated = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=output_len,
                                 min_new_tokens=output_len, pad_token_id=0)
            generated += out.shape[1] - len(p)
    wall = time.perf_counter() - started
    return {"output_tokens": generated, "seconds": wall, "tok_per_s": generated / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-requests", type=int, default=3, help="sequential generate calls for the reference")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", default="auto", help="auto: CUDA when torch sees a GPU")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = resolve_model_dir("embedded")
    max_c = max(args.concurrency)
    config = EngineConfig(model=str(model_dir), dtype=args.dtype, max_num_seqs=max(max_c, 1),
                          max_num_batched_tokens=2048, kv_cache_bytes=2 * 1024**3, device=args.device,
                          cuda_graphs=not args.no_cuda_graphs)
    engine = LLMEngine(config)
    run_engine(engine, random_prompts(2, args.prompt_len, 49152, seed=99), 4)  # warm-up
    device = engine.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    results = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {where}",
               "cuda_graphs": engine.runner.graphs is not None,
               "dtype": args.dtype, "prompt_len": args.prompt_len, "output_len": args.output_len, "engine": {}}
    for c in args.concurrency:
        results["engine"][c] = run_engine(engine, random_prompts(c, args.prompt_len, 49152, seed=c), args.output_len)
        r = results["engine"][c]
        print(f"engine c={c}: {r['output_tokens']} tokens in {r['seconds']:.1f}s = {r['tok_per_s']:.1f} tok/s "
              f"(TTFT p50 {r['ttft_p50_s']:.2f}s)", flush=True)
    hf = run_hf(model_dir, random_prompts(args.hf_requests, args.prompt_len, 49152, seed=7), args.output_len,
                config.torch_dtype(), device)
    results["hf_sequential"] = hf
    print(f"transformers sequential generate: {hf['output_tokens']} tokens in {hf['seconds']:.1f}s = "
          f"{hf['tok_per_s']:.1f} tok/s")
    for c, r in results["engine"].items():
        print(f"ratio c={c}: {r['tok_per_s'] / hf['tok_per_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
