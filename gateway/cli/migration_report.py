"""The parity report as a text table (what `llmgw migration-report` prints)."""

from __future__ import annotations

from typing import Any


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _pair(a: str, b: str) -> str:
    return f"{a} | {b}"


def format_report(report: dict[str, Any]) -> str:
    backends = ", ".join(f"{name} {state}" for name, state in report["backends"].items())
    lines = [f"config {report['config_version']}; backends: {backends}"]
    columns = ["model", "primary -> candidate", "compared", "exact", "prefix", "dropped", "TTFT p50 ms",
               "TTFT p95 ms", "latency p50 ms", "latency p95 ms", "errors"]
    rows = []
    for row in report["pairs"]:
        p, c = row["primary_stats"], row["candidate_stats"]
        rows.append([
            row["model"], f"{row['primary']} -> {row['candidate']}", str(row["compared"]),
            _pct(row["exact_match_rate"]), _pct(row["mean_common_prefix_ratio"]), str(row["dropped"]),
            _pair(_ms(p["ttft_p50_s"]), _ms(c["ttft_p50_s"])), _pair(_ms(p["ttft_p95_s"]), _ms(c["ttft_p95_s"])),
            _pair(_ms(p["latency_p50_s"]), _ms(c["latency_p50_s"])),
            _pair(_ms(p["latency_p95_s"]), _ms(c["latency_p95_s"])),
            _pair(_pct(p["error_rate"]), _pct(c["error_rate"]))])
    widths = [max(len(x) for x in [col, *(r[i] for r in rows)]) for i, col in enumerate(columns)]
    lines.append("  ".join(col.ljust(w) for col, w in zip(columns, widths)))
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows]
    if not rows:
        lines.append("(no shadow traffic recorded yet)")
    lines.append("pairs of timings read primary | candidate")
    return "\n".join(lines)
