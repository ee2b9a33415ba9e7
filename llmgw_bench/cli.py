"""`llmgw bench --url URL --api API ...` and `llmgw bench compare A.json B.json`."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from llmgw_bench import workload
from llmgw_bench.api import APIS
from llmgw_bench.compare import compare
from llmgw_bench.metrics import parse_slo, summarize
from llmgw_bench.plots import write_plots
from llmgw_bench.report import print_runs
from llmgw_bench.resources import ResourceSampler
from llmgw_bench.runner import LoadSpec, Target, run_load


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw bench", description="TTFT, TPOT, ITL and tokens/s of a TGI or "
                                     "OpenAI-compatible endpoint. `llmgw bench compare A.json B.json` sets two "
                                     "results side by side.")
    target = parser.add_argument_group("target")
    target.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    target.add_argument("--api", required=True, choices=APIS)
    target.add_argument("--model", default=None, help="default: the first of GET /v1/models (OpenAI APIs)")
    target.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    target.add_argument("--header", action="append", default=[], metavar="NAME:VALUE")
    target.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    data = parser.add_argument_group("workload")
    data.add_argument("--dataset", choices=("random", "sharegpt", "prompts"), default="random")
    data.add_argument("--dataset-path", type=Path, default=None, help="ShareGPT JSON, or prompts (.txt / .jsonl)")
    data.add_argument("--input-len", type=int, default=100, help="random: prompt tokens")
    data.add_argument("--output-len", type=int, default=128, help="max new tokens (sharegpt: overrides the data)")
    data.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in len·(1±ratio)")
    data.add_argument("--prefix-len", type=int, default=0, help="random: tokens of a prefix shared by all prompts")
    data.add_argument("--tokenizer", default="server",
                      help="a local Hugging Face tokenizer directory, or 'server' for the server's /tokenize")
    data.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len (OpenAI APIs)")
    data.add_argument("--temperature", type=float, default=0.0)
    data.add_argument("--seed", type=int, default=0, help="workload and arrivals; same seed, same requests")
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", default=None, help="closed loop; a list sweeps: 1,8,32,128")
    load.add_argument("--request-rate", type=float, default=None, help="open loop, requests/s (Poisson)")
    load.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of arrival gaps; 1 is Poisson")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (open loop)")
    load.add_argument("--num-requests", default=None,
                      help="measured requests per run (default 100); a list gives one per --concurrency level")
    load.add_argument("--duration", type=float, default=None, help="seconds of sending per run, instead")
    load.add_argument("--warmup", type=int, default=2, help="requests sent before each run, not measured")
    load.add_argument("--slo", default=None, help="goodput targets, e.g. ttft=500ms,tpot=50ms,e2el=10s")
    watch = parser.add_argument_group("resources")
    watch.add_argument("--pid", type=int, default=None, help="a local server process to sample (CPU, memory)")
    watch.add_argument("--metrics-url", default=None, help="Prometheus endpoint; default URL/metrics")
    watch.add_argument("--no-metrics", action="store_true", help="do not scrape the server's /metrics")
    watch.add_argument("--sample-interval", type=float, default=0.5)
    out = parser.add_argument_group("output")
    out.add_argument("--output", type=Path, default=None, help="result JSON (default llmgw-bench-<time>.json)")
    out.add_argument("--plots-dir", type=Path, default=None, help="PNG plots (default <output stem>-plots)")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")
    return parser


def _headers(args: argparse.Namespace) -> dict[str, str]:
    headers = {}
    for item in args.header:
        name, sep, value = item.partition(":")
        if not sep:
            raise SystemExit(f"llmgw bench: --header wants NAME:VALUE, got {item!r}")
        headers[name.strip()] = value.strip()
    if args.api_key:
        headers["authorization"] = f"Bearer {args.api_key}"
    return headers


def _model(args: argparse.Namespace, headers: dict[str, str]) -> str | None:
    if args.model or args.api == "tgi":
        return args.model
    try:
        response = httpx.get(f"{args.url}/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise SystemExit(f"llmgw bench: cannot list models at {args.url}/v1/models ({exc}); give --model") from exc


def _samples(args: argparse.Namespace, model: str | None, headers: dict[str, str], count: int) -> list[Any]:
    counter = (workload.server_counter(args.url, model, headers) if args.tokenizer == "server"
               else workload.local_counter(args.tokenizer))
    if args.dataset == "random":
        return workload.random_samples(counter, count, args.input_len, args.output_len, range_ratio=args.range_ratio,
                                       prefix_len=args.prefix_len, seed=args.seed)
    if args.dataset_path is None:
        raise SystemExit(f"llmgw bench: --dataset {args.dataset} needs --dataset-path")
    if args.dataset == "sharegpt":
        explicit = "--output-len" in sys.argv or any(a.startswith("--output-len=") for a in sys.argv)
        return workload.sharegpt_samples(args.dataset_path, counter, count,
                                         output_len=args.output_len if explicit else None, seed=args.seed)
    return workload.prompt_file_samples(args.dataset_path, counter, args.output_len)


def _integers(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError as exc:
        raise SystemExit(f"llmgw bench: {flag} wants integers like 1,8,32 ({exc})") from exc
    if any(v < 1 for v in values):
        raise SystemExit(f"llmgw bench: {flag} values must be at least 1")
    return values


def _loads(args: argparse.Namespace) -> list[LoadSpec]:
    levels = _integers(args.concurrency or "1", "--concurrency")
    if args.num_requests is not None:
        counts: list[int | None] = list(_integers(args.num_requests, "--num-requests"))
    else:
        counts = [None if args.duration else 100]
    if len(counts) == 1:
        counts = counts * len(levels)
    if len(counts) != len(levels):
        raise SystemExit("llmgw bench: --num-requests needs one value, or one per --concurrency level")
    if args.request_rate is not None:
        if args.concurrency:
            raise SystemExit("llmgw bench: give --concurrency or --request-rate, not both")
        return [LoadSpec(request_rate=args.request_rate, burstiness=args.burstiness,
                         max_concurrency=args.max_concurrency, num_requests=counts[0], duration=args.duration,
                         warmup=args.warmup)]
    return [LoadSpec(concurrency=level, num_requests=count, duration=args.duration, warmup=args.warmup)
            for level, count in zip(levels, counts)]


def bench(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.url = args.url.rstrip("/")
    console = Console(stderr=True)
    headers = _headers(args)
    try:
        slo = parse_slo(args.slo) if args.slo else None
    except ValueError as exc:
        raise SystemExit(f"llmgw bench: {exc}") from exc
    if args.ignore_eos and args.api == "tgi":
        console.print("[yellow]TGI's API has no ignore_eos: outputs may stop before --output-len[/]")
    model = _model(args, headers)
    loads = _loads(args)
    pool = max((load.num_requests or 0) for load in loads) or 200  # a duration run cycles through 200 prompts
    console.print(f"preparing {pool} prompts ({args.dataset}, tokenizer: {args.tokenizer})")
    samples = _samples(args, model, headers, pool)
    target = Target(args.url, args.api, model, headers, temperature=args.temperature, ignore_eos=args.ignore_eos,
                    seed=args.seed if args.temperature > 0 else None, timeout=args.timeout)
    metrics_url = None if args.no_metrics else (args.metrics_url or f"{args.url}/metrics")
    started = datetime.datetime.now(datetime.UTC)
    runs = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=args.no_progress) as progress:
        for load in loads:
            task = progress.add_task(load.label, total=load.num_requests)
            with ResourceSampler(pid=args.pid, metrics_url=metrics_url, interval=args.sample_interval,
                                 headers=headers) as sampler:
                results, duration = asyncio.run(run_load(target, samples, load, seed=args.seed,
                                                         on_done=lambda _r, t=task: progress.advance(t),
                                                         on_start=sampler.mark_start))
            summary = summarize(results, duration, slo)
            if (spec := sampler.spec_decode()) is not None:
                summary["spec_decode"] = spec
            runs.append({"label": load.label, "concurrency": load.concurrency, "request_rate": load.request_rate,
                         "summary": summary,
                         "requests": [r.as_json() for r in results],
                         "resources": {"samples": sampler.samples, "summary": sampler.summary(),
                                       "notes": sampler.notes}})
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"}
    settings["model"] = model
    result = {"tool": "llmgw bench", "format": 1, "started_at": started.isoformat(), "settings": settings,
              "workload": {"requests": len(samples), "mean_input_len": sum(s.input_len for s in samples) / len(samples),
                           "mean_output_len": sum(s.output_len for s in samples) / len(samples)},
              "runs": runs}
    output = args.output or Path(f"llmgw-bench-{started:%Y%m%d-%H%M%S}.json")
    output.write_text(json.dumps(result, indent=1))
    print_runs(runs, Console())
    console.print(f"result: {output}")
    if not args.no_plots:
        for path in write_plots({output.stem: result}, args.plots_dir or output.with_name(f"{output.stem}-plots")):
            console.print(f"plot: {path}")
    return 0 if all(run["summary"]["completed"] for run in runs) else 1


def build_compare_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw bench compare", description="two results side by side")
    parser.add_argument("baseline", type=Path)
    parser.add_argument("candidate", type=Path)
    parser.add_argument("--plots-dir", type=Path, default=None, help="default: <candidate stem>-vs-<baseline>")
    parser.add_argument("--no-plots", action="store_true")
    return parser


def main(argv: list[str]) -> int:
    if argv and argv[0] == "compare":
        args = build_compare_parser().parse_args(argv[1:])
        return compare(args.baseline, args.candidate, plots_dir=None if args.no_plots else (
            args.plots_dir or args.candidate.with_name(f"{args.candidate.stem}-vs-{args.baseline.stem}")))
    return bench(argv)
