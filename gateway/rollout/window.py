"""What a rollout step has seen, per side: live requests (latencies, errors by class, tool calls and
structured output checked) and mirrored pairs (agreement, prompt-token parity). Windows are plain data:
each gateway replica keeps its own for the current step and stores it, and the leader merges them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.telemetry.record import RequestRecord

MAX_SAMPLES = 4000  # latency samples kept per side and step: bounded memory and stored size
MAX_EXAMPLES = 5  # diverging answers kept per step, for the decision log and the console

# kinds of GatewayError (gateway/errors.py) that are the backend's fault, by class; the rest (a bad request,
# the gateway's own limits) say nothing about a backend
ERROR_CLASSES = {"upstream": "5xx", "internal": "5xx", "unavailable": "5xx", "healthcheck": "5xx",
                 "timeout": "timeout", "overloaded": "upstream_429", "rate_limited": "upstream_429"}


def error_class(rec: RequestRecord) -> str | None:
    """None: served; else the class of failure. A stream that broke after its 200 is `truncated`."""
    if rec.status < 400 and not rec.error:
        return None
    if rec.status < 400:
        return "truncated"
    return ERROR_CLASSES.get(rec.error_kind or "", "5xx" if rec.status >= 500 else None)


@dataclass
class Side:
    requests: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tool_answers: int = 0  # answers that made tool calls...
    tool_valid: int = 0  # ...whose every call named a declared tool with arguments that match its schema
    structured: int = 0  # answers held to a JSON schema...
    structured_valid: int = 0  # ...that parse and match it

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def observe(self, rec: RequestRecord) -> None:
        if rec.status == 499:  # the client left: says nothing about the backend
            return
        failure = error_class(rec)
        if failure is None and rec.status >= 400:
            return  # refused before any backend ran (bad input, limits)
        self.requests += 1
        if failure is not None:
            self.errors[failure] = self.errors.get(failure, 0) + 1
            return
        if rec.ttft is not None:
            keep(self.ttft, rec.ttft)
            if rec.ended is not None and rec.generated_tokens > 1:
                keep(self.tpot, (rec.ended - rec.started - rec.ttft) / (rec.generated_tokens - 1))
        if rec.tool_calls_valid is not None:
            self.tool_answers += 1
            self.tool_valid += rec.tool_calls_valid
        if rec.structured_valid is not None:
            self.structured += 1
            self.structured_valid += rec.structured_valid

    def merge(self, other: Side) -> None:
        self.requests += other.requests
        for k, v in other.errors.items():
            self.errors[k] = self.errors.get(k, 0) + v
        self.ttft = (self.ttft + other.ttft)[-MAX_SAMPLES:]
        self.tpot = (self.tpot + other.tpot)[-MAX_SAMPLES:]
        self.tool_answers += other.tool_answers
        self.tool_valid += other.tool_valid
        self.structured += other.structured
        self.structured_valid += other.structured_valid


@dataclass
class Pairs:
    """Mirrored requests answered by both sides (greedy ones count for agreement)."""

    greedy: int = 0
    exact: int = 0
    diverged: int = 0  # greedy pairs with token-level top-k data at their first divergence...
    contained: int = 0  # ...where each side's token was in the other's top-k there
    prompt_compared: int = 0
    prompt_mismatch: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)  # a few diverging answers

    def merge(self, other: Pairs) -> None:
        for name in ("greedy", "exact", "diverged", "contained", "prompt_compared", "prompt_mismatch"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.examples = (self.examples + other.examples)[-MAX_EXAMPLES:]


@dataclass
class Window:
    baseline: Side = field(default_factory=Side)
    candidate: Side = field(default_factory=Side)
    pairs: Pairs = field(default_factory=Pairs)
    shadow_baseline: Side = field(default_factory=Side)  # the mirrored requests' timings: the shadow phase's
    shadow_candidate: Side = field(default_factory=Side)  # only latency evidence

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Window:
        return cls(**{name: (Pairs if name == "pairs" else Side)(**value) for name, value in data.items()})

    def merge(self, other: Window) -> None:
        for name in ("baseline", "candidate", "pairs", "shadow_baseline", "shadow_candidate"):
            getattr(self, name).merge(getattr(other, name))

    @property
    def empty(self) -> bool:
        return self == Window()


def keep(values: list[float], value: float) -> None:
    values.append(value)
    if len(values) > MAX_SAMPLES:
        del values[: len(values) - MAX_SAMPLES]
