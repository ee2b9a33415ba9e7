"""The gates: each turns a step's window into pass, fail, inconclusive or no_data, with its figures.

A gate fails only when its confidence bound is past the threshold (evidence of harm), and passes only when
the other bound is within it (evidence of no harm); in between it is inconclusive and the step waits for
more samples. A gate whose signal did not occur in the window (no tool calls asked for, say) has no_data
and does not hold a step. Zero thresholds (prompt-token parity, structured output under a constraint)
are exact: one mismatch fails, none in enough samples passes."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from gateway.rollout.spec import RolloutSpec
from gateway.rollout.stats import quantile_bounds, rate_difference, ratio_bounds, spent_alpha, wilson, z_for
from gateway.rollout.window import Side, Window


@dataclass
class GateResult:
    name: str
    threshold: float
    value: float | None
    low: float | None
    high: float | None
    status: str  # pass | fail | inconclusive | no_data
    baseline_samples: int
    candidate_samples: int
    detail: str

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("value", "low", "high"):  # JSON has no infinity: an unbounded side is null
            if data[key] is not None and not math.isfinite(data[key]):
                data[key] = None
        return data


def evaluate(spec: RolloutSpec, window: Window, look: int, shadow: bool) -> list[GateResult]:
    """Every configured gate, at the `look`-th look of this step (`shadow`: from mirrored pairs only)."""
    z = z_for(spent_alpha(spec.alpha, look) / 2)  # each gate's two bounds (or two sides) share the look's alpha
    g, m = spec.gates, spec.min_samples
    base, cand = (window.shadow_baseline, window.shadow_candidate) if shadow else (window.baseline, window.candidate)
    out: list[GateResult] = []
    if g.on("ttft_p95_ratio"):
        out.append(_ratio("ttft_p95_ratio", cand.ttft, base.ttft, 0.95, g.ttft_p95_ratio, z, m))
    if g.on("tpot_p50_ratio"):
        out.append(_ratio("tpot_p50_ratio", cand.tpot, base.tpot, 0.5, g.tpot_p50_ratio, z, m))
    if g.on("error_rate_increase"):
        out += _errors(cand, base, g.error_rate_increase, z, m)
    p = window.pairs
    if g.on("min_agreement"):
        out.append(_at_least("agreement", p.exact, p.greedy, g.min_agreement, z, m,
                             "exact-match rate of greedy mirrored answers"))
    if g.on("min_topk_containment"):
        out.append(_at_least("topk_containment", p.contained, p.diverged, g.min_topk_containment, z, m,
                             "diverging greedy answers whose tokens at the divergence are in the other's top-k"))
    if g.on("tool_call_validity_drop") and not shadow:
        out.append(_drop("tool_call_validity", cand.tool_valid, cand.tool_answers, base.tool_valid,
                         base.tool_answers, g.tool_call_validity_drop, z, m, "answers whose tool calls are valid"))
    if g.on("structured_validity_drop") and not shadow:
        out.append(_drop("structured_validity", cand.structured_valid, cand.structured, base.structured_valid,
                         base.structured, g.structured_validity_drop, z, m, "answers that match their JSON schema"))
    if g.on("prompt_token_mismatch"):
        out.append(_at_most("prompt_token_parity", p.prompt_mismatch, p.prompt_compared, g.prompt_token_mismatch,
                            z, m, "mirrored requests whose prompt_tokens differ"))
    return out


def _status(low: float, high: float, threshold: float, worse_above: bool) -> str:
    if worse_above:
        return "fail" if low > threshold else "pass" if high <= threshold else "inconclusive"
    return "fail" if high < threshold else "pass" if low >= threshold else "inconclusive"


def _ratio(name: str, cand: list[float], base: list[float], q: float, threshold: float, z: float,
           m: int) -> GateResult:
    what = f"candidate p{int(q * 100)} / baseline p{int(q * 100)}"
    if not cand:
        return GateResult(name, threshold, None, None, None, "no_data", len(base), 0, what)
    value, (low, high) = ratio_bounds(cand, base, q, z)
    if min(len(cand), len(base)) < m:
        status = "inconclusive"
    elif high <= threshold:
        status = "pass"
    elif low > threshold or _exceeds(cand, base, q, threshold, z):
        status = "fail"
    else:
        status = "inconclusive"
    return GateResult(name, threshold, value, low, high, status, len(base), len(cand), what)


def _exceeds(cand: list[float], base: list[float], q: float, threshold: float, z: float) -> bool:
    """Evidence that the candidate's q-quantile is past threshold x the baseline's, on fewer samples than
    the quantile's own interval needs: more than 1 - q of the candidate's samples (by the Wilson lower bound)
    lie above threshold x the baseline's upper bound (its largest sample while too few bound it)."""
    _, base_high = quantile_bounds(base, q, z)
    line = threshold * (base_high if math.isfinite(base_high) else max(base))
    above = sum(v > line for v in cand)
    return wilson(above, len(cand), z)[0] > 1 - q


def _errors(cand: Side, base: Side, threshold: float, z: float, m: int) -> list[GateResult]:
    """All errors together, then each class that occurred on either side on its own (more timeouts must not
    hide behind fewer 5xx)."""
    out = [_error_rate("error_rate", cand.error_count, cand.requests, base.error_count, base.requests, threshold,
                       z, m, "all classes")]
    for kind in sorted(set(cand.errors) | set(base.errors)):
        out.append(_error_rate(f"error_rate_{kind}", cand.errors.get(kind, 0), cand.requests,
                               base.errors.get(kind, 0), base.requests, threshold, z, m, kind))
    return out


def _error_rate(name: str, ck: int, cn: int, bk: int, bn: int, threshold: float, z: float, m: int,
                kind: str) -> GateResult:
    what = f"candidate error rate - baseline's ({kind}: {ck} of {cn} against {bk} of {bn})"
    if not cn:
        return GateResult(name, threshold, None, None, None, "no_data", bn, 0, what)
    d, (low, high) = rate_difference(ck, cn, bk, bn, z)
    status = _status(low, high, threshold, True) if min(cn, bn) >= m else "inconclusive"
    return GateResult(name, threshold, d, low, high, status, bn, cn, what)


def _drop(name: str, ck: int, cn: int, bk: int, bn: int, threshold: float, z: float, m: int,
          what: str) -> GateResult:
    """baseline's rate - candidate's, at most `threshold` (0: exact, the candidate may not be worse at all)."""
    if not cn:
        return GateResult(name, threshold, None, None, None, "no_data", bn, 0, f"{what}: baseline - candidate")
    d, (low, high) = rate_difference(bk, bn, ck, cn, z)
    if min(bn, cn) < m:  # a drop is against the baseline: it needs the baseline's figures too
        status = "inconclusive"
    elif threshold == 0:  # exact: the candidate may not be worse at all (a constraint is not statistics)
        status = "fail" if ck / cn < bk / bn else "pass"
    else:
        status = _status(low, high, threshold, True)
    return GateResult(name, threshold, d, low, high, status, bn, cn, f"{what}: baseline - candidate")


def _at_least(name: str, k: int, n: int, threshold: float, z: float, m: int, what: str) -> GateResult:
    if not n:
        return GateResult(name, threshold, None, None, None, "no_data", n, n, what)
    low, high = wilson(k, n, z)
    if threshold >= 1:  # exact: one miss fails it
        status = "fail" if k < n else "pass" if n >= m else "inconclusive"
    else:
        status = _status(low, high, threshold, False) if n >= m else "inconclusive"
    return GateResult(name, threshold, k / n, low, high, status, n, n, what)


def _at_most(name: str, k: int, n: int, threshold: float, z: float, m: int, what: str) -> GateResult:
    if not n:
        return GateResult(name, threshold, None, None, None, "no_data", 0, 0, what)
    low, high = wilson(k, n, z)
    if threshold == 0:
        status = "fail" if k else "pass" if n >= m else "inconclusive"
    else:
        status = _status(low, high, threshold, True) if n >= m else "inconclusive"
    return GateResult(name, threshold, k / n, low, high, status, n, n, what)

