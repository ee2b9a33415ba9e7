"""The gateway's engine backend against llama.cpp's llama-server: same GGUF weights, same bits, same workload.

Each server runs alone on the machine, one after the other, and `llmgw bench` (as in engine_vs_vllm.py: same
seed, same requests) measures streaming /v1/completions against it; `llmgw bench compare` and a markdown table
per pair follow. Pairs (--pairs):

- bf16: the engine, quantization "none"                   vs  llama.cpp on a BF16 GGUF
- q8:   the engine, quantization "int8"                   vs  llama.cpp on a Q8_0 GGUF
- q4:   the engine on the 4-bit GGUF itself, "auto"       vs  llama.cpp on the same file

The engine's activations are in --dtype, "auto" by default: bf16 where the CPU has native bf16, else fp32 (an
AVX2-only CPU, where bf16 would run torch's slow paths: a Q4_1 c=1 TPOT of 20 ms against 10 in fp32).

The weights default to the embedded SmolLM2-135M-Instruct (its Q4_1 GGUF); llama.cpp's BF16 and Q8_0 files
are made from that GGUF with `llama-quantize --allow-requantize`, so both servers see the same values. The
engine serves "embedded" (the converted Hugging Face directory) for bf16 and q8, and the .gguf for q4; with
--gguf it serves that file for all three. llama.cpp's `llama-server` and `llama-quantize` are built once from
the llama.cpp vendored in the llama-cpp-python sdist (PyPI is the only source needed) into
~/.cache/llm-gateway/llama.cpp/<version>/ (6 min on 2 cores, nice'd; skipped when the binaries are there).
llama-server is started with one slot per request in flight (-np), all CPUs (-t) and --no-repack.

With --rounds N both servers of a pair are up at once and measured in turn N times, and the summary gives each
round's ratios and their median: this VM's speed drifts by tens of percent from one minute to the next, and
alternating puts the drift on both sides alike.

Nothing else may run meanwhile: llama.cpp's threads wait for each other at every op, and one busy core turned
its c=1 TPOT p50 of 14 ms into multi-second stalls here. A warning is printed when the load average is up.
Results (llmgw bench JSON, server logs, cpu.txt, summary.md) go to --out-dir.

    .venv/bin/python benchmarks/engine_vs_llamacpp.py --build-only
    .venv/bin/python benchmarks/engine_vs_llamacpp.py                      # all pairs, bench-results/llamacpp
    .venv/bin/python benchmarks/engine_vs_llamacpp.py --pairs q4 --gguf /path/to/model-q4_k_m.gguf
    .venv/bin/python benchmarks/engine_vs_llamacpp.py --pairs q8,bf16 --concurrency 1 --num-requests 16 --rounds 6
    .venv/bin/python benchmarks/engine_vs_llamacpp.py --pairs q8 --only llamacpp --concurrency 1 --num-requests 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_vs_vllm import GATEWAY_CONFIG, bench, describe_cpu, running_server  # noqa: E402
from engine_core.loader import embedded_gguf_path, resolve_model_dir  # noqa: E402

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CACHE = Path.home() / ".cache/llm-gateway/llama.cpp" / LLAMA_CPP_PYTHON_VERSION
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF",  # else it fetches the web UI from Hugging Face at build time
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DBUILD_SHARED_LIBS=OFF"]  # self-contained binaries: the build tree is deleted after
TARGETS = ["llama-server", "llama-quantize"]


def build_llamacpp(cache: Path = CACHE, jobs: int = 2) -> Path:
    """bin/ with llama-server and llama-quantize, built once from the llama-cpp-python sdist's llama.cpp."""
    bin_dir = cache / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    cmake = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if cmake is None:
        raise SystemExit("building llama.cpp needs cmake: apt-get install cmake, or .venv/bin/pip install cmake")
    with tempfile.TemporaryDirectory(prefix="llamacpp-build-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = Path(tmp) / "build"
        configure = [cmake, "-S", str(source), "-B", str(build), *CMAKE_FLAGS]
        compile_ = ["nice", "-n", "10", cmake, "--build", str(build), "-j", str(jobs), "--target", *TARGETS]
        started = time.monotonic()
        for command in (configure, compile_):
            print("+", shlex.join(command), flush=True)
            subprocess.run(command, check=True)
        bin_dir.mkdir(parents=True, exist_ok=True)
        for target in TARGETS:  # whole files or none: their presence is what skips the next build
            shutil.copy2(build / "bin" / target, bin_dir / f".{target}.tmp")
            os.replace(bin_dir / f".{target}.tmp", bin_dir / target)
        minutes = (time.monotonic() - started) / 60
    (cache / "build-info.txt").write_text(f"{' '.join(configure)}\n{' '.join(compile_)}\n{minutes:.1f} min\n")
    print(f"llama.cpp built in {minutes:.1f} min: {bin_dir}", flush=True)
    return bin_dir


# pair: (the engine's quantization, llama.cpp's file type; None: the source GGUF itself)
PAIRS: dict[str, tuple[str, str | None]] = {"bf16": ("none", "BF16"), "q8": ("int8", "Q8_0"), "q4": ("auto", None)}
ENGINE_URL, LLAMACPP_URL = "http://127.0.0.1:8411", "http://127.0.0.1:8413"


def llamacpp_weights(bin_dir: Path, gguf: Path, file_type: str | None) -> Path:
    """`gguf` re-quantized to `file_type` by llama-quantize into the cache (once), or `gguf` itself."""
    if file_type is None:
        return gguf
    out = CACHE / "weights" / f"{gguf.stem}.{file_type}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        command = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(tmp), file_type]
        print("+", shlex.join(command), flush=True)
        done = subprocess.run(command, capture_output=True, text=True)  # a line per tensor: shown only on failure
        if done.returncode:
            raise SystemExit(f"llama-quantize failed ({done.returncode}):\n{done.stderr[-4000:]}")
        tmp.rename(out)
    return out


def llamacpp_command(bin_dir: Path, weights: Path, args: argparse.Namespace) -> list[str]:
    slots = max(int(c) for c in args.concurrency.split(","))
    # per slot: the longest prompt (--range-ratio 0.1 in bench()) and output, padded to 256 as llama.cpp pads it
    ctx = slots * -(-(int(args.input_len * 1.1) + args.output_len + 64) // 256) * 256
    command = [str(bin_dir / "llama-server"), "-m", str(weights), "--alias", "bench", "-np", str(slots),
               "-t", str(os.cpu_count()), "-c", str(ctx), "--host", "127.0.0.1", "--port", LLAMACPP_URL.rsplit(":")[-1]]
    # llama.cpp's weight repacking crashed at start on an Intel CPU with Q8_0 and Q4_1: keep it off
    help_text = subprocess.run([command[0], "--help"], capture_output=True, text=True).stdout
    if "--no-repack" in help_text:
        command.append("--no-repack")
        print("llama.cpp: --no-repack (weights served as stored, not repacked)", flush=True)
    else:
        print("llama.cpp: this build has no --no-repack; weights may be repacked", flush=True)
    return command


def engine_command(model: str, quantization: str, args: argparse.Namespace, config: Path) -> list[str]:
    extra = f'quantization = "{quantization}"' + (f"\nnum_threads = {args.num_threads}" if args.num_threads else "")
    config.write_text(GATEWAY_CONFIG.format(
        model=model, dtype=args.dtype, extra=extra,
        max_num_seqs=max(int(c) for c in args.concurrency.split(",")), max_batched=args.max_num_batched_tokens))
    return [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", ENGINE_URL.rsplit(":")[-1],
            "--log-level", "warning"]


def check_idle(name: str) -> None:
    load = os.getloadavg()[0]
    if load > 0.5:  # llama.cpp's spinning threads suffer most from a busy CPU: its figures fall several-fold
        print(f"WARNING: load average {load:.1f} before {name}: something else is running; figures will be off",
              flush=True)


def measure(url: str, pid: int, output: Path, args: argparse.Namespace, seed: int = 0) -> None:
    # `Connection: close` for both servers (the same client): llama-server announces keep-alive but closes the
    # connection after each streamed answer, and the next request on it failed, every other request
    bench(url, pid, output, args, extra=("--header", "Connection: close", "--seed", str(seed)))


def serve(name: str, command: list[str], url: str, output: Path, args: argparse.Namespace) -> None:
    check_idle(name)
    print("+", shlex.join(command), flush=True)
    with running_server(name, command, url, args.out_dir / f"{name}.log") as proc:
        measure(url, proc.pid, output, args)


def serve_alternating(pair: str, engine: list[str], llamacpp: list[str],
                      args: argparse.Namespace) -> dict[int, dict[str, Path]]:
    """Both servers up at once, measured in turn --rounds times (who goes first alternates), so that a drift in the
    machine's speed falls on both sides alike. An idle server takes no CPU: each waits for requests. Returns each
    round's `llmgw bench` JSON by side."""
    check_idle(pair)
    outputs: dict[int, dict[str, Path]] = {}
    with contextlib.ExitStack() as stack:
        procs = {}
        for side, command, url in (("engine", engine, ENGINE_URL), ("llamacpp", llamacpp, LLAMACPP_URL)):
            print("+", shlex.join(command), flush=True)
            procs[side] = stack.enter_context(running_server(f"{side}-{pair}", command, url,
                                                             args.out_dir / f"{side}-{pair}.log")), url
        for round_ in range(args.rounds):
            order = ("engine", "llamacpp") if round_ % 2 == 0 else ("llamacpp", "engine")
            for side in order:
                output = args.out_dir / f"{side}-{pair}-round{round_ + 1}.json"
                print(f"\n== {pair}: {side}, round {round_ + 1} of {args.rounds}", flush=True)
                proc, url = procs[side]
                # new prompts each round (the same for both sides): llama-server keeps each slot's last prompt, and
                # the round before's prompts came back at a 10 ms TTFT
                measure(url, proc.pid, output, args, seed=round_)
                outputs.setdefault(round_ + 1, {})[side] = output
    return outputs


def figures(path: Path) -> dict[str, float]:
    """c=1 output tok/s and TPOT p50 (ms), and output tok/s at the highest concurrency, from `llmgw bench`'s JSON."""
    if not path.exists():
        return {}
    runs: list[dict[str, Any]] = [r for r in json.loads(path.read_text())["runs"] if r.get("concurrency")]
    single = next((r["summary"] for r in runs if r["concurrency"] == 1), None)
    top = max(runs, key=lambda r: r["concurrency"], default=None)
    out: dict[str, float] = {}
    if single:
        out["c=1 output tok/s"] = single["output_throughput"]
        if single["tpot_s"]["p50"] is not None:
            out["c=1 TPOT p50 (ms)"] = single["tpot_s"]["p50"] * 1000
    if top and top["concurrency"] > 1:
        out[f"c={top['concurrency']} output tok/s"] = top["summary"]["output_throughput"]
    out["failed requests"] = sum(r["summary"]["failed"] for r in runs)
    return out


def table(pair: str, ours: dict[str, float], theirs: dict[str, float], cpu: str) -> str:
    cell = lambda v: "-" if v is None else f"{v:.1f}" if v != int(v) else f"{v:.0f}"
    lines = [f"### {pair}  ({cpu})", "", "| metric | engine | llama.cpp | engine / llama.cpp |", "|---|---:|---:|---:|"]
    for key in dict.fromkeys([*ours, *theirs]):
        a, b = ours.get(key), theirs.get(key)
        ratio = f"{a / b:.2f}x" if a and b and key != "failed requests" else "-"
        lines.append(f"| {key} | {cell(a)} | {cell(b)} | {ratio} |")
    return "\n".join([*lines, "", "(tok/s: higher is better; TPOT: lower is better)"]) + "\n"


def rounds_table(pair: str, outputs: dict[int, dict[str, Path]], cpu: str) -> str:
    """Each round's figures and ratios, then the medians: the table above over the rounds' median figures."""
    by_round = {round_: {side: figures(path) for side, path in sides.items()} for round_, sides in outputs.items()}
    keys = [k for k in dict.fromkeys(k for r in by_round.values() for k in r["engine"]) if k != "failed requests"]
    lines = [f"### {pair}, {len(by_round)} alternating rounds  ({cpu})", "",
             "| round | " + " | ".join(f"{k}: engine / llama.cpp" for k in keys) + " |",
             "|---|" + "---:|" * len(keys)]
    ratios: dict[str, list[float]] = {k: [] for k in keys}
    for round_, sides in sorted(by_round.items()):
        cells = []
        for key in keys:
            a, b = sides["engine"].get(key), sides["llamacpp"].get(key)
            if a and b:
                ratios[key].append(a / b)
            cells.append(f"{a:.1f} / {b:.1f} = {a / b:.2f}x" if a and b else "-")
        lines.append(f"| {round_} | " + " | ".join(cells) + " |")
    lines.append("| median ratio | " + " | ".join(
        f"{statistics.median(ratios[k]):.2f}x (range {min(ratios[k]):.2f}-{max(ratios[k]):.2f})" if ratios[k] else "-"
        for k in keys) + " |")
    median = lambda side: {k: statistics.median(r[side][k] for r in by_round.values() if k in r[side])
                           for k in [*keys, "failed requests"] if any(k in r[side] for r in by_round.values())}
    failed = lambda side: sum(r[side].get("failed requests", 0) for r in by_round.values())
    ours, theirs = median("engine"), median("llamacpp")
    ours["failed requests"], theirs["failed requests"] = failed("engine"), failed("llamacpp")
    return "\n".join(lines) + "\n\n" + table(f"{pair}, medians of the rounds", ours, theirs, cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build-only", action="store_true", help="build llama.cpp (if not cached) and stop")
    parser.add_argument("--pairs", default="bf16,q8,q4", help=f"any of {','.join(PAIRS)}")
    parser.add_argument("--only", choices=("engine", "llamacpp"), default=None, help="run one side only")
    parser.add_argument("--gguf", type=Path, default=None, help="default: the embedded SmolLM2's Q4_1 GGUF")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--num-requests", default="16,64", help="per concurrency level")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--api", default="openai-completions")
    parser.add_argument("--dtype", default="auto",
                        help="the engine's (auto: bf16 where the CPU has it, else fp32, as the engine picks)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-threads", type=int, default=None, help="the engine's torch threads")
    parser.add_argument("--rounds", type=int, default=1,
                        help="over 1: both servers up at once, measured in turn this many times (a pair at a time)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench-results/llamacpp")
    args = parser.parse_args()
    if unknown := set(args.pairs.split(",")) - set(PAIRS):
        parser.error(f"--pairs: no pair {', '.join(sorted(unknown))}; pairs are {', '.join(PAIRS)}")
    if args.rounds > 1 and args.only:
        parser.error("--rounds measures both sides in turn: it takes no --only")
    bin_dir = build_llamacpp()
    if args.build_only:
        return
    gguf = args.gguf.expanduser().resolve() if args.gguf else embedded_gguf_path()
    # bench() reads the tokenizer from args.model: the Hugging Face directory converted from the same GGUF
    args.model = resolve_model_dir(str(gguf) if args.gguf else "embedded")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cpu = describe_cpu()
    print(cpu, flush=True)
    (args.out_dir / "cpu.txt").write_text(cpu + "\n")
    tables = []
    for pair in args.pairs.split(","):
        quantization, file_type = PAIRS[pair]
        model = str(gguf) if args.gguf or file_type is None else "embedded"
        if args.rounds > 1:
            print(f"\n== {pair}: engine (model {model}, dtype {args.dtype}, quantization {quantization}) "
                  f"and llama.cpp, {args.rounds} alternating rounds", flush=True)
            outputs = serve_alternating(
                pair, engine_command(model, quantization, args, args.out_dir / f"engine-{pair}.toml"),
                llamacpp_command(bin_dir, llamacpp_weights(bin_dir, gguf, file_type), args), args)
            tables.append(rounds_table(pair, outputs, cpu))
            continue
        engine_json, llamacpp_json = args.out_dir / f"engine-{pair}.json", args.out_dir / f"llamacpp-{pair}.json"
        if args.only != "llamacpp":
            command = engine_command(model, quantization, args, args.out_dir / f"engine-{pair}.toml")
            print(f"\n== {pair}: engine, model {model}, dtype {args.dtype}, quantization {quantization}", flush=True)
            serve(f"engine-{pair}", command, ENGINE_URL, engine_json, args)
        if args.only != "engine":
            print(f"\n== {pair}: llama.cpp", flush=True)
            command = llamacpp_command(bin_dir, llamacpp_weights(bin_dir, gguf, file_type), args)
            serve(f"llamacpp-{pair}", command, LLAMACPP_URL, llamacpp_json, args)
        if engine_json.exists() and llamacpp_json.exists():  # with --only, from an earlier run into the same folder
            print(f"\n== {pair}: llama.cpp (A) against the engine (B)", flush=True)
            subprocess.run([sys.executable, "-m", "gateway", "bench", "compare", str(llamacpp_json),
                            str(engine_json)], check=True, cwd=ROOT)
        tables.append(table(pair, figures(engine_json), figures(llamacpp_json), cpu))
    summary = "\n".join(tables)
    print("\n" + summary, flush=True)
    (args.out_dir / "summary.md").write_text(summary)


if __name__ == "__main__":
    main()
