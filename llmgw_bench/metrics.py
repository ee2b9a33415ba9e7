"""A run's figures, by `vllm bench serve`'s definitions (README: "llmgw bench").

- TTFT: send to the first event with text. E2EL: send to the last event with text.
- TPOT: (E2EL − TTFT) / (output tokens − 1), one value per request with more than one token.
- ITL: the gaps between events with text, pooled over all requests (percentiles are over gaps).
- Throughputs divide by the run's duration, first send to last answer.
- Goodput: requests meeting every SLO given, per second.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import numpy as np

from llmgw_bench.api import RequestResult

PERCENTILES = (50, 90, 95, 99)
SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=500ms,tpot=50ms,e2el=2s` → seconds by metric."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        match = re.fullmatch(r"([0-9.]+)\s*(ms|s)?", value.strip())
        if key.strip() not in SLO_KEYS or match is None:
            raise ValueError(f"bad SLO {part!r}: expected {'|'.join(SLO_KEYS)}=<number>ms|s")
        number = float(match.group(1))
        slo[key.strip()] = number / 1000 if match.group(2) in (None, "ms") else number
    return slo


def tpot(result: RequestResult) -> float | None:
    if result.ttft is None or result.latency is None or not result.output_tokens or result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def distribution(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "std": None, **{f"p{p}": None for p in PERCENTILES}}
    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()), "std": float(array.std()),
            **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}}


def meets(result: RequestResult, slo: dict[str, float]) -> bool:
    """Within every limit; a one-token answer has no TPOT and passes that limit, as in vLLM."""
    values = {"ttft": result.ttft, "tpot": tpot(result) or 0.0, "e2el": result.latency}
    return all((value := values[key]) is not None and value <= limit for key, limit in slo.items())


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float] | None = None) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens or 0 for r in done)
    prompt = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in done)
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    summary: dict[str, Any] = {
        "requests": len(results), "completed": len(done), "failed": len(results) - len(done),
        "errors": dict(Counter(r.error for r in results if r.error)),
        "duration_s": duration, "total_input_tokens": prompt, "total_output_tokens": output,
        "request_throughput": per_second(len(done)), "output_throughput": per_second(output),
        "total_token_throughput": per_second(prompt + output),
        "ttft_s": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": distribution([t for r in done if (t := tpot(r)) is not None]),
        "itl_s": distribution([gap for r in done for gap in r.itl]),
        "e2el_s": distribution([r.latency for r in done if r.latency is not None]),
    }
    if slo:
        good = sum(1 for r in done if meets(r, slo))
        summary["slo_s"] = slo
        summary["good_requests"] = good
        summary["goodput"] = per_second(good)
    return summary
