"""Replica routing: the gateway's balancers against SGLang's router over the same two engine replicas.

Two engine replicas (gateway processes, one CPU thread each, prefix caching on) each get a KV cache that
holds about half of the workload's distinct prefixes, plus room for the requests running on it. In front,
one at a time: our gateway with an `openai` pool over both (`balance = "prefix"`, `"round_robin"`,
`"least_load"`) and SGLang's router (`sglang-router`, `--policy cache_aware`, its CLI defaults). A front
named `policy@N` is our gateway with `[server] workers = N`: N front processes on one port, each request on
a new connection so that the kernel hands each to any front (gateway/serving/front_feed.py shares their prefix
choices). The replicas restart before each front, so every run starts with cold caches.

Workloads (random-word text, as SGLang's generated-shared-prefix benchmark; the order is shuffled):
- shared prefix: --groups groups x --per-group prompts, a --prefix-words shared prefix and a
  --question-words question each, --output-len tokens out (ignore_eos);
- zero-reuse control: as many prompts, each with a prefix of its own.
Reported: output tok/s, TTFT p50/p90 (streaming /v1/completions at --concurrency), and the replicas'
share of prompt tokens served from their prefix caches (blocks reused, from their /metrics).
--rounds N runs every front N times, interleaved, each against fresh replicas. Each round's ratios to
round robin and to SGLang's router are taken within the round; the summary gives their median and every
round's figure, since one run's ratio moves by several percent on a shared machine.

    .venv-router/bin/pip install sglang-router==0.3.2                     # once, in its own venv
    .venv/bin/python benchmarks/replica_routing.py --out-dir bench-results/routing
    .venv/bin/python benchmarks/replica_routing.py --fronts prefix round_robin --workloads shared_prefix --rounds 3
    .venv/bin/python benchmarks/replica_routing.py --fronts prefix prefix@2 round_robin --workloads shared_prefix
    .venv/bin/python benchmarks/replica_routing.py --prefix-words 2000 --rounds 2   # SGLang's default prefix length
    .venv/bin/python benchmarks/replica_routing.py --groups 4 --per-group 4 --prefix-words 200   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_vs_vllm import describe_cpu, running_server  # noqa: E402
from tests.server import free_port  # noqa: E402

FRONTS_KEY = "replica-routing-bench"  # with [state] (several fronts) every request needs a key
REFERENCES = ("round_robin", "sglang-router")  # each front's tok/s and TTFT p50 are also given as ratios to these
KV_BYTES_PER_TOKEN_BF16 = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: layers x (k, v) x kv heads x head dim x 2 bytes

REPLICA_CONFIG = """
default_model = "smollm2"
[server]
port = {port}
[backends.local]
type = "engine"
model = "embedded"
kv_cache_mb = {kv_mb}
num_threads = 1
enable_prefix_caching = true
max_num_seqs = 16
[models.smollm2]
backend = "local"
max_input_tokens = 4000
max_total_tokens = 4096
"""

FRONT_CONFIG = """
default_model = "smollm2"
[server]
port = {port}
[backends.pool]
type = "openai"
model = "smollm2"
endpoints = [{endpoints}]
balance = "{policy}"
balance_abs_threshold = {abs_threshold}
first_token_timeout = 600
idle_timeout = 600
[models.smollm2]
backend = "pool"
max_input_tokens = 4000
max_total_tokens = 4096
{fronts}"""


def word_list(seed: int) -> list[str]:
    """Words that SmolLM2's tokenizer keeps as one token each, so N words are about N tokens."""
    from transformers import AutoTokenizer

    from engine_core.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("embedded"))
    words = sorted({t[1:] for t in tokenizer.get_vocab() if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 3})
    random.Random(seed).shuffle(words)
    return words[:4000]


def tokens_per_word(prompts: list[str]) -> float:
    from transformers import AutoTokenizer

    from engine_core.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("embedded"))
    return sum(len(tokenizer.encode(p)) for p in prompts) / sum(len(p.split()) for p in prompts)


def workload(words: list[str], groups: int, per_group: int, prefix_words: int, question_words: int,
             seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = " ".join(rng.choices(words, k=prefix_words))
        prompts += [prefix + "\n\n" + " ".join(rng.choices(words, k=question_words)) for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


async def one_request(client: httpx.AsyncClient, prompt: str, output_len: int) -> dict[str, Any]:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft, usage, tokens = None, {}, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = ttft if ttft is not None else time.perf_counter() - started
                tokens += 1
            usage = chunk.get("usage") or usage
    return {"ttft": ttft if ttft is not None else time.perf_counter() - started,
            "output_tokens": usage.get("completion_tokens", tokens), "prompt_tokens": usage.get("prompt_tokens", 0)}


async def run_workload(url: str, prompts: list[str], output_len: int, concurrency: int,
                       new_connections: bool = False) -> dict[str, Any]:
    queue = list(prompts)
    results: list[dict[str, Any]] = []
    errors = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors
        while queue:
            prompt = queue.pop(0)
            try:
                results.append(await one_request(client, prompt, output_len))
            except httpx.HTTPError:
                errors += 1

    started = time.perf_counter()
    limits = httpx.Limits(max_keepalive_connections=0) if new_connections else httpx.Limits()
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits,
                                 headers={"authorization": f"Bearer {FRONTS_KEY}"}) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - started
    ttfts = sorted(r["ttft"] for r in results)

    def pct(q: float) -> float:
        return 1e3 * ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else math.nan

    return {"requests": len(results), "errors": errors, "seconds": wall,
            "output_tok_per_s": sum(r["output_tokens"] for r in results) / wall,
            "ttft_p50_ms": pct(0.5), "ttft_p90_ms": pct(0.9),
            "ttft_mean_ms": 1e3 * statistics.fmean(ttfts) if ttfts else math.nan,
            "prompt_tokens": sum(r["prompt_tokens"] for r in results)}


def metric_samples(url: str) -> list[Any]:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text) for s in family.samples]


def replica_figures(replicas: list[str], prompt_tokens: int, seconds: float, block_size: int = 16) -> dict[str, Any]:
    """Each replica's prefix-cache blocks looked up and reused (the engine's own counters; a lookup stops at
    the first miss), the share of all prompt tokens served from the caches, and the share of the run each
    replica spent in engine steps (busy: the rest it idled)."""
    queries, hits, busy = [], [], []
    for url in replicas:
        values = {s.name: s.value for s in metric_samples(url) if not s.labels.get("le")}
        queries.append(values.get("llmgw_engine_prefix_cache_queries_total", 0.0))
        hits.append(values.get("llmgw_engine_prefix_cache_hits_total", 0.0))
        busy.append(values.get("llmgw_engine_step_seconds_sum", 0.0) / seconds)
    return {"prefix_queries": queries, "prefix_hits": hits, "replica_busy": busy,
            "prefix_hit_rate": sum(hits) * block_size / prompt_tokens if prompt_tokens else 0.0}


def front_choices(front_url: str) -> dict[str, int]:
    """Our gateway's balancer choices in the run, as `replica/reason`: count."""
    return {f"{s.labels['replica']}/{s.labels['reason']}": int(s.value) for s in metric_samples(front_url)
            if s.name == "llmgw_balancer_choices_total"}


def start_replicas(stack: ExitStack, out: Path, kv_mb: int, tag: str) -> list[str]:
    urls = []
    for i in range(2):
        port = free_port()
        config = out / f"replica{i}.toml"
        config.write_text(REPLICA_CONFIG.format(port=port, kv_mb=kv_mb))
        url = f"http://127.0.0.1:{port}"
        stack.enter_context(running_server(f"replica {i}", [str(ROOT / ".venv/bin/llmgw"), "serve", "--config",
                                                            str(config), "--port", str(port)],
                                           url, out / f"replica{i}-{tag}.log"))
        urls.append(url)
    return urls


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far, with its children's (a gateway of several fronts supervises
    them); the front shares the machine's cores with the replicas."""
    process = psutil.Process(pid)
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        times = p.cpu_times()
        total += times.user + times.system
    return total


def start_front(stack: ExitStack, out: Path, front: str, replicas: list[str],
                abs_threshold: float) -> tuple[str, subprocess.Popen]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if front == "sglang-router":
        router = ROOT / ".venv-router/bin/python"
        command = [str(router), "-m", "sglang_router.launch_router", "--worker-urls", *replicas,
                   "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
                   "--health-check-endpoint", "/health"]
        return url, stack.enter_context(running_server(front, command, url, out / f"{front}.log"))
    config = out / f"front-{front}.toml"
    policy, _, workers = front.partition("@")
    fronts = ""
    if workers:  # several front processes need the state store: an SQLite file of this run
        (out / f"state-{front}.db").unlink(missing_ok=True)
        fronts = (f'\n[state]\ndatabase = "sqlite:///{out / f"state-{front}.db"}"\n\n'
                  f'[[auth.keys]]\nname = "bench"\nkey = "{FRONTS_KEY}"\n')
    config.write_text(FRONT_CONFIG.format(port=port, endpoints=", ".join(f'"{u}"' for u in replicas),
                                          policy=policy, abs_threshold=abs_threshold, fronts=fronts)
                      .replace("[server]\n", f"[server]\nworkers = {workers}\n" if workers else "[server]\n"))
    return url, stack.enter_context(running_server(f"gateway {front}", [str(ROOT / ".venv/bin/llmgw"), "serve",
                                                                     "--config", str(config), "--port", str(port)],
                                                    url, out / f"front-{front}.log"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prefix-words", type=int, default=600)
    parser.add_argument("--question-words", type=int, default=50)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--fronts", nargs="+", default=["prefix", "round_robin", "least_load", "sglang-router"])
    parser.add_argument("--workloads", nargs="+", default=["shared_prefix", "zero_reuse"])
    parser.add_argument("--abs-threshold", type=float, default=8.0, help="the prefix policy's imbalance gate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every front this many times, interleaved; ratios are per round, then the median")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench-results" / "routing")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{describe_cpu()}", flush=True)

    words = word_list(args.seed)
    shared = workload(words, args.groups, args.per_group, args.prefix_words, args.question_words, args.seed)
    control = workload(words, args.groups * args.per_group, 1, args.prefix_words, args.question_words, args.seed + 1)
    # about half the distinct prefixes, plus the requests running on one replica when the load is even
    per_word = tokens_per_word(shared[:8])
    prefix_tokens = math.ceil(args.prefix_words * per_word)
    request_tokens = math.ceil((args.prefix_words + args.question_words) * per_word) + args.output_len
    kv_tokens = args.groups * prefix_tokens // 2 + math.ceil(args.concurrency / 2) * request_tokens
    kv_mb = math.ceil(kv_tokens * KV_BYTES_PER_TOKEN_BF16 / 2**20)
    print(f"{len(shared)} prompts of ~{request_tokens - args.output_len} tokens ({per_word:.2f} a word); "
          f"{args.groups} shared prefixes of ~{prefix_tokens} tokens; each replica's KV cache {kv_mb} MiB "
          f"(~{kv_tokens} tokens in bf16)", flush=True)

    rounds: list[dict[str, dict[str, Any]]] = []
    for round_index in range(args.rounds):
        results: dict[str, dict[str, Any]] = {}
        for front in args.fronts:
            if front == "sglang-router" and not (ROOT / ".venv-router/bin/python").exists():
                print("sglang-router: skipped, no .venv-router (see the docstring)", flush=True)
                continue
            for name, prompts in (("shared_prefix", shared), ("zero_reuse", control)):
                if name in args.workloads:
                    figures = run_front(args, front, prompts, words, kv_mb, f"{front}-{name}-{round_index}")
                    results.setdefault(front, {})[name] = figures
                    print_figures(f"round {round_index + 1}: {front}", name, figures)
        rounds.append(results)

    print(f"== {describe_cpu()}")
    summary = summarize(rounds)
    for front, runs in summary.items():
        for name, entry in runs.items():
            print(f"{front:14s} {name:13s}: {statistics.median(entry['output_tok_per_s']):6.1f} tok/s, TTFT p50 "
                  f"{statistics.median(entry['ttft_p50_ms']):7.0f} ms{describe_ratios(entry)}")
    (args.out_dir / "replica_routing.json").write_text(json.dumps({"cpu": describe_cpu(), "args": vars(args) | {
        "out_dir": str(args.out_dir)}, "rounds": rounds, "summary": summary}, indent=2))
    print(f"results: {args.out_dir / 'replica_routing.json'}")


def run_front(args: argparse.Namespace, front: str, prompts: list[str], words: list[str], kv_mb: int,
              tag: str) -> dict[str, Any]:
    """One front over two fresh replicas (cold caches): a warm-up request, then the workload."""
    with ExitStack() as stack:
        replicas = start_replicas(stack, args.out_dir, kv_mb, tag)
        url, proc = start_front(stack, args.out_dir, front, replicas, args.abs_threshold)
        asyncio.run(run_workload(url, ["warm up " + " ".join(words[:20])], 4, 1))
        cpu_before = cpu_seconds(proc.pid)
        figures = asyncio.run(run_workload(url, prompts, args.output_len, args.concurrency, "@" in front))
        figures["front_cpu_seconds"] = cpu_seconds(proc.pid) - cpu_before
        figures |= replica_figures(replicas, figures["prompt_tokens"], figures["seconds"])
        if front != "sglang-router":
            figures["choices"] = front_choices(url)
    return figures


def print_figures(label: str, name: str, figures: dict[str, Any]) -> None:
    print(f"{label:24s} {name:13s}: {figures['output_tok_per_s']:6.1f} tok/s, TTFT p50 "
          f"{figures['ttft_p50_ms']:7.0f} ms, p90 {figures['ttft_p90_ms']:7.0f} ms, prefix hits "
          f"{100 * figures['prefix_hit_rate']:4.1f}% of prompt tokens (blocks reused per replica "
          f"{[int(h) for h in figures['prefix_hits']]}), replicas busy "
          f"{[round(b, 2) for b in figures['replica_busy']]}, front CPU {figures['front_cpu_seconds']:.1f} s, "
          f"errors {figures['errors']}"
          f"{', choices ' + str(figures['choices']) if 'choices' in figures else ''}", flush=True)


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Per front and workload, each round's figures, and each round's ratios to the reference fronts in that
    same round, so that the machine's drift between rounds cancels."""
    summary: dict[str, dict[str, dict[str, list[float]]]] = {}
    for results in rounds:
        for front, runs in results.items():
            for name, f in runs.items():
                entry = summary.setdefault(front, {}).setdefault(name, {})
                entry.setdefault("output_tok_per_s", []).append(f["output_tok_per_s"])
                entry.setdefault("ttft_p50_ms", []).append(f["ttft_p50_ms"])
                for reference in REFERENCES:
                    base = results.get(reference, {}).get(name)
                    if base is not None and reference != front:
                        entry.setdefault(f"tok_per_s_vs_{reference}", []).append(
                            f["output_tok_per_s"] / base["output_tok_per_s"])
                        entry.setdefault(f"ttft_p50_vs_{reference}", []).append(f["ttft_p50_ms"] / base["ttft_p50_ms"])
    return summary


def describe_ratios(entry: dict[str, list[float]]) -> str:
    parts = []
    for reference in REFERENCES:
        ratios = entry.get(f"tok_per_s_vs_{reference}")
        if ratios:
            parts.append(f"{statistics.median(ratios):.2f}x {reference}'s tok/s (rounds "
                         f"{', '.join(f'{r:.2f}x' for r in ratios)}), TTFT p50 "
                         f"{statistics.median(entry[f'ttft_p50_vs_{reference}']):.2f}x")
    return f" ({'; '.join(parts)})" if parts else ""


if __name__ == "__main__":
    main()
