"""PNG plots of one or more results: TTFT and latency CDFs, and for sweeps, figures against concurrency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _cdf(axis: Any, values: list[float], label: str, style: str = "-") -> None:
    if not values:
        return
    ordered = np.sort(np.asarray(values) * 1000)
    axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), style, label=label)


def write_plots(results: dict[str, dict[str, Any]], directory: Path) -> list[Path]:
    """`results`: a name for each result file (one, or two for compare) → its JSON. Returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    styles = ["-", "--", ":", "-."]
    figure, (ttft, e2el) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, (name, result) in enumerate(results.items()):
        for run in result["runs"]:
            label = f"{name} {run['label']}" if len(results) > 1 else run["label"]
            done = [r for r in run["requests"] if r["ok"]]
            _cdf(ttft, [r["ttft"] for r in done], label, styles[index % 4])
            _cdf(e2el, [r["latency"] for r in done], label, styles[index % 4])
    for axis, title in ((ttft, "TTFT"), (e2el, "End-to-end latency")):
        axis.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    written.append(_save(figure, directory / "latency_cdf.png"))

    sweeps = {name: [run for run in result["runs"] if run.get("concurrency")] for name, result in results.items()}
    if any(len(runs) > 1 for runs in sweeps.values()):
        figure, (throughput, first) = plt.subplots(1, 2, figsize=(12, 4.5))
        for name, runs in sweeps.items():
            runs = sorted(runs, key=lambda run: run["concurrency"])
            x = [run["concurrency"] for run in runs]
            throughput.plot(x, [run["summary"]["output_throughput"] for run in runs], "o-", label=name)
            for stat, style in (("p50", "o-"), ("p99", "s--")):
                first.plot(x, [1000 * (run["summary"]["ttft_s"][stat] or np.nan) for run in runs], style,
                           label=f"{name} {stat}")
        throughput.set(title="Output tokens/s against concurrency", xlabel="concurrency", ylabel="tok/s")
        first.set(title="TTFT against concurrency", xlabel="concurrency", ylabel="ms")
        for axis in (throughput, first):
            axis.set_xscale("log", base=2)
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
        written.append(_save(figure, directory / "sweep.png"))

    sampled = [(f"{name} {run['label']}", run["resources"]["samples"]) for name, result in results.items()
               for run in result["runs"] if run.get("resources", {}).get("samples")]
    keys = sorted({k for _, samples in sampled for s in samples for k in s if k != "t"})
    if keys:
        figure, axes = plt.subplots(len(keys), 1, figsize=(10, 2.4 * len(keys)), squeeze=False)
        for axis, key in zip(axes[:, 0], keys):
            for label, samples in sampled:
                points = [(s["t"], s[key]) for s in samples if key in s]
                if points:
                    axis.plot(*zip(*points), label=label)
            axis.set(ylabel=key)
            axis.grid(alpha=0.3)
        axes[-1, 0].set(xlabel="seconds into the run")
        axes[0, 0].legend(fontsize=8)
        written.append(_save(figure, directory / "resources.png"))
    return written


def _save(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
