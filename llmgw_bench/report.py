"""The summary table printed after a run, and the rows `compare` sets side by side."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

# (label, path into a run's summary, scale to display units); the first five are "higher is better"
ROWS: list[tuple[str, tuple[str, ...], float]] = [
    ("Completed requests", ("completed",), 1),
    ("Request throughput (req/s)", ("request_throughput",), 1),
    ("Output token throughput (tok/s)", ("output_throughput",), 1),
    ("Total token throughput (tok/s)", ("total_token_throughput",), 1),
    ("Goodput (req/s)", ("goodput",), 1),
    ("Failed requests", ("failed",), 1),
    ("Duration (s)", ("duration_s",), 1),
    ("Total input tokens", ("total_input_tokens",), 1),
    ("Total output tokens", ("total_output_tokens",), 1),
]
for _metric, _name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT (excl. 1st token)"), ("itl_s", "ITL (pooled gaps)"),
                       ("e2el_s", "E2E latency")):
    for _stat in ("mean", "p50", "p90", "p95", "p99"):
        ROWS.append((f"{_name} {_stat} (ms)", (_metric, _stat), 1000))
# the server's speculative decoding over the measured requests, where its /metrics has the counters
for _key, _name in (("drafts", "drafts"), ("draft_tokens", "draft tokens"), ("accepted_tokens", "accepted tokens"),
                    ("acceptance_rate", "acceptance rate"), ("mean_acceptance_length", "mean acceptance length")):
    ROWS.append((f"Spec decode {_name}", ("spec_decode", _key), 1))


def value_at(summary: dict[str, Any], path: tuple[str, ...], scale: float) -> float | None:
    node: Any = summary
    for key in path:
        if not isinstance(node, dict) or node.get(key) is None:
            return None
        node = node[key]
    return float(node) * scale


def cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 or value == int(value) else f"{value:,.2f}"


def print_runs(runs: list[dict[str, Any]], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="llmgw bench", show_lines=False)
    table.add_column("metric")
    for run in runs:
        table.add_column(run["label"], justify="right")
    for label, path, scale in ROWS:
        values = [value_at(run["summary"], path, scale) for run in runs]
        if all(v is None for v in values):
            continue
        table.add_row(label, *(cell(v) for v in values))
    if any(run["summary"]["errors"] for run in runs):
        table.add_row("Errors by kind", *(", ".join(f"{k}: {v}" for k, v in run["summary"]["errors"].items()) or "-"
                                          for run in runs))
    for key in sorted({k for run in runs for k in run.get("resources", {}).get("summary", {})}):
        table.add_row(f"{key} mean / max",
                      *(_resource(run.get("resources", {}).get("summary", {}).get(key)) for run in runs))
    console.print(table)


def _resource(stats: dict[str, float] | None) -> str:
    return "-" if stats is None else f"{cell(stats['mean'])} / {cell(stats['max'])}"
