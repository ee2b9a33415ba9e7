"""A mirrored request's two answers (gateway/routing/shadow.py's pair) into a rollout window: both sides'
timings and errors for the shadow phase, and for greedy requests whether the answers agree, where they
first diverge, and whether each side's token there was in the other's top-k (vLLM's check_logprobs_close)."""

from __future__ import annotations

from typing import Any

from gateway.rollout.window import MAX_EXAMPLES, Side, Window, keep


def add_pair(window: Window, pair: Any) -> None:
    primary, candidate = pair.primary, pair.candidate
    _timings(window.shadow_baseline, primary)
    _timings(window.shadow_candidate, candidate)
    if primary.error is not None or candidate.error is not None:
        return
    p = window.pairs
    if primary.prompt_tokens is not None and candidate.prompt_tokens is not None:
        p.prompt_compared += 1
        p.prompt_mismatch += primary.prompt_tokens != candidate.prompt_tokens
    if not pair.greedy:
        return
    p.greedy += 1
    if primary.text == candidate.text:
        p.exact += 1
        return
    at = _first_divergence(primary.tokens_text, candidate.tokens_text)
    contained = _contained(primary, candidate, at)
    if contained is not None:
        p.diverged += 1
        p.contained += contained
    p.examples = (p.examples + [{"at_token": at, "baseline": primary.text[:2000],
                                 "candidate": candidate.text[:2000]}])[-MAX_EXAMPLES:]


def _timings(side: Side, answer: Any) -> None:
    side.requests += 1
    if answer.error is not None:
        side.errors["5xx"] = side.errors.get("5xx", 0) + 1
        return
    if answer.ttft is not None:
        keep(side.ttft, answer.ttft)
        if answer.tokens > 1:
            keep(side.tpot, (answer.latency - answer.ttft) / (answer.tokens - 1))


def _first_divergence(a: list[str], b: list[str]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _contained(primary: Any, candidate: Any, at: int) -> bool | None:
    """Each side's token at the divergence within the other's top-k, where that side sent its top-k
    (the mirror always asks the candidate for it; the primary has it when the client asked); None when
    neither side has top-k there, or one answer simply ended first."""
    if at >= len(primary.tokens_text) or at >= len(candidate.tokens_text):
        return None
    checks = []
    if at < len(candidate.top_texts) and candidate.top_texts[at]:
        checks.append(primary.tokens_text[at] in candidate.top_texts[at])
    if at < len(primary.top_texts) and primary.top_texts[at]:
        checks.append(candidate.tokens_text[at] in primary.top_texts[at])
    return all(checks) if checks else None
