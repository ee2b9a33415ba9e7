"""One rollout's state and its transitions: what the leader decides from the gates, and what an operator
asks for. Pure data and rules; gateway/rollout/manager.py stores it and routes by it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any

import msgspec

from gateway.rollout.gates import GateResult, evaluate
from gateway.rollout.spec import RolloutSpec
from gateway.rollout.stats import quantile
from gateway.rollout.window import Window

ACTIVE = ("shadow", "running", "paused")  # states that route or mirror traffic to the candidate
FINISHED = ("promoted", "rolled_back", "aborted")


class RolloutConflict(Exception):
    """An operator's action that does not apply in the rollout's state (a 409)."""


@dataclass
class Rollout:
    model: str
    baseline: str
    spec: RolloutSpec
    state: str = "running"  # shadow | running | paused | promoted | rolled_back | aborted
    step: int = 0  # index into spec.steps; -1 while shadowing
    epoch: int = 0  # bumped at every step change: windows are per epoch
    step_started: float = field(default_factory=time.time)
    looks: int = 0  # looks at this step so far (each spends alpha: gateway/rollout/stats.py)...
    looked_samples: int = 0  # ...the last one at this many samples
    last_look: float = 0.0
    paused_from: str | None = None  # the state a pause interrupted
    gates: list[dict[str, Any]] = field(default_factory=list)  # the last look's results
    window: dict[str, Any] = field(default_factory=dict)  # the last look's merged window, summarised

    @classmethod
    def begin(cls, model: str, baseline: str, spec: RolloutSpec) -> Rollout:
        shadow = spec.shadow_seconds > 0
        return cls(model, baseline, spec, state="shadow" if shadow else "running", step=-1 if shadow else 0)

    # what routing reads

    @property
    def weight(self) -> float:
        """The candidate's share of live traffic now, in percent."""
        if self.state == "promoted":
            return 100.0
        if self.state in ("running", "paused") and self.step >= 0:
            return self.spec.steps[self.step]
        return 0.0

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    # the leader's look

    def due(self, now: float) -> bool:
        return self.state in ("shadow", "running") and now - self.last_look >= self.spec.analysis_interval

    def worth_a_look(self, window: Window, now: float) -> bool:
        """Look again once the samples grew by half since the last look (so n samples cost about
        log1.5(n) looks of the step's alpha, not one per interval), or when the step ran out of time."""
        n = self._samples(window)
        return n >= self.spec.min_samples and n >= 1.5 * self.looked_samples \
            or now - self.step_started >= self.spec.step_max_seconds

    def _samples(self, window: Window) -> int:
        if self.state == "shadow":
            return window.shadow_candidate.requests
        return window.candidate.requests + window.pairs.greedy

    def look(self, window: Window, now: float) -> tuple[str, str] | None:
        """Evaluate the gates on this step's window; the decision (action, reason) or None to wait."""
        self.looks += 1
        self.last_look, self.looked_samples = now, self._samples(window)
        shadow = self.state == "shadow"
        results = evaluate(self.spec, window, self.looks, shadow)
        self.gates = [r.to_json() for r in results]
        self.window = summarise(window)
        failed = [r for r in results if r.status == "fail"]
        if failed:  # evidence of harm: out at once, whatever the step's minimums
            return "rollback", "; ".join(_figures(r) for r in failed)
        elapsed = now - self.step_started
        spec = self.spec
        if shadow:
            ready = elapsed >= spec.shadow_seconds and window.shadow_candidate.requests >= spec.shadow_min_requests
        else:
            ready = elapsed >= spec.step_min_seconds and window.candidate.requests >= spec.step_min_requests
        waiting = [r for r in results if r.status == "inconclusive"]
        if ready and not waiting:
            nxt = self.step + 1
            if self.spec.steps[nxt] >= 100:
                return "promote", "every gate passed at " + self._where()
            return "advance", f"every gate passed at {self._where()}; to {self.spec.steps[nxt]:g}%"
        if elapsed >= self.spec.step_max_seconds:
            why = ", ".join(r.name for r in waiting) or "too few requests"
            return "inconclusive", f"still inconclusive after {elapsed:.0f} s at {self._where()} ({why})"
        return None

    def _where(self) -> str:
        return "the shadow phase" if self.step < 0 else f"step {self.step + 1} ({self.spec.steps[self.step]:g}%)"

    # transitions: the leader's decisions and the operator's actions alike

    def apply(self, action: str, now: float) -> None:
        if action in ("advance", "promote") and self.state not in ("shadow", "running", "paused"):
            raise RolloutConflict(f"cannot {action} a rollout that is {self.state}")
        if action == "advance":
            self._to_step(self.step + 1, now)
            self.state = "running"
        elif action == "promote":
            self.state = "promoted"
        elif action in ("rollback", "abort"):
            if self.state in FINISHED:
                raise RolloutConflict(f"the rollout is already {self.state}")
            self.state = "rolled_back" if action == "rollback" else "aborted"
        elif action in ("pause", "inconclusive"):
            if self.state not in ("shadow", "running"):
                raise RolloutConflict(f"cannot pause a rollout that is {self.state}")
            self.paused_from, self.state = self.state, "paused"
        elif action == "resume":
            if self.state != "paused":
                raise RolloutConflict(f"only a paused rollout resumes; this one is {self.state}")
            self.state, self.paused_from = self.paused_from or "running", None
            self.step_started = now  # a fresh hold at this step; its window is kept
        elif action == "step_back":
            if self.state not in ACTIVE or self.step < 0 or (self.step == 0 and self.spec.shadow_seconds <= 0):
                raise RolloutConflict("there is no earlier step to go back to")
            self._to_step(self.step - 1, now)
            self.state = "shadow" if self.step < 0 else "running"
        else:
            raise ValueError(action)

    def _to_step(self, step: int, now: float) -> None:
        self.step, self.epoch, self.step_started, self.looks, self.gates = step, self.epoch + 1, now, 0, []
        self.looked_samples = 0

    def decision(self, action: str, reason: str, by: str, now: float, gates: list[dict[str, Any]]) -> dict[str, Any]:
        """The audit log's entry: where the action left the rollout, and the figures it was taken on."""
        return {"at": now, "action": action, "step": self.step, "weight": self.weight, "state": self.state,
                "reason": reason, "by": by, "gates": gates}

    # stored form

    def to_doc(self) -> dict[str, Any]:
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["spec"] = msgspec.to_builtins(self.spec)
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Rollout:
        fields = {k: v for k, v in doc.items() if k != "spec"}
        return cls(spec=msgspec.convert(doc["spec"], RolloutSpec), **fields)


def _figures(result: GateResult) -> str:
    value = "-" if result.value is None else f"{result.value:.3g}"
    bounds = f"[{result.low:.3g}, {result.high:.3g}]" if result.low is not None and result.high is not None else ""
    return (f"{result.name} {value} {bounds} against {result.threshold:g} "
            f"(baseline {result.baseline_samples}, candidate {result.candidate_samples} samples)")


def summarise(window: Window) -> dict[str, Any]:
    def side(s: Any) -> dict[str, Any]:
        return {"requests": s.requests, "errors": dict(s.errors), "ttft_p95_s": quantile(s.ttft, 0.95),
                "tpot_p50_s": quantile(s.tpot, 0.5), "tool_answers": s.tool_answers, "tool_valid": s.tool_valid,
                "structured": s.structured, "structured_valid": s.structured_valid}

    p = window.pairs
    return {"baseline": side(window.baseline), "candidate": side(window.candidate),
            "shadow_baseline": side(window.shadow_baseline), "shadow_candidate": side(window.shadow_candidate),
            "pairs": {"greedy": p.greedy, "exact": p.exact, "diverged": p.diverged, "contained": p.contained,
                      "prompt_compared": p.prompt_compared, "prompt_mismatch": p.prompt_mismatch,
                      "examples": p.examples}}
