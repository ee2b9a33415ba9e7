"""`llmgw bench compare A.json B.json`: runs with the same label side by side, with B/A ratios."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmgw_bench.plots import write_plots
from llmgw_bench.report import ROWS, cell, value_at


def compare(baseline: Path, candidate: Path, *, plots_dir: Path | None, console: Console | None = None) -> int:
    console = console or Console()
    first, second = (json.loads(path.read_text()) for path in (baseline, candidate))
    by_label = {run["label"]: run for run in second["runs"]}
    shared = [run for run in first["runs"] if run["label"] in by_label]
    if not shared:
        console.print(f"no run labels in common: {[r['label'] for r in first['runs']]} vs {list(by_label)}")
        return 1
    for run in shared:
        other = by_label[run["label"]]
        table = Table(title=f"{run['label']}: {baseline.stem} (A) vs {candidate.stem} (B)")
        for column in ("metric", "A", "B", "B/A"):
            table.add_column(column, justify="left" if column == "metric" else "right")
        for label, path, scale in ROWS:
            a, b = value_at(run["summary"], path, scale), value_at(other["summary"], path, scale)
            if a is None and b is None:
                continue
            ratio = f"{b / a:.2f}x" if a and b is not None else "-"
            table.add_row(label, cell(a), cell(b), ratio)
        console.print(table)
    if plots_dir is not None:
        for path in write_plots({baseline.stem: first, candidate.stem: second}, plots_dir):
            console.print(f"plot: {path}")
    return 0
