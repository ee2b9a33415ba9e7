"""What a rollout is asked to do: `[models.<name>.rollout]` in config, or the body of POST /admin/rollouts."""

from __future__ import annotations

import msgspec

DEFAULT_STEPS = [1.0, 5.0, 25.0, 50.0, 100.0]


class Gates(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Each gate compares the candidate with the baseline over the same window; None turns a gate off.
    Ratios and differences are candidate against baseline; rates are 0-1."""

    ttft_p95_ratio: float | None = 1.2
    """Candidate TTFT p95 / baseline TTFT p95, at most."""
    tpot_p50_ratio: float | None = 1.2
    """Candidate TPOT p50 / baseline TPOT p50, at most."""
    error_rate_increase: float | None = 0.02
    """Candidate error rate - baseline's, at most (all classes)."""
    min_agreement: float | None = 0.8
    """Exact-match rate of greedy mirrored answers, at least."""
    min_topk_containment: float | None = 1.0
    """At the first divergence, each token in the other's top-k, at least."""
    tool_call_validity_drop: float | None = 0.02
    """Baseline valid-call rate - candidate's, at most."""
    structured_validity_drop: float | None = 0.0
    """Baseline valid-JSON rate - candidate's, at most."""
    prompt_token_mismatch: float | None = 0.0
    """Share of mirrored requests whose prompt_tokens differ, at most."""
    off: list[str] = []
    """Gates turned off by name (TOML has no null), e.g. ["tpot_p50_ratio"]."""

    def on(self, name: str) -> bool:
        return getattr(self, name) is not None and name not in self.off


class RolloutSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A staged move of a model from its backend to a candidate, step by step, held back by gates."""

    candidate: str
    """The backend the model moves to."""
    steps: list[float] = msgspec.field(default_factory=lambda: list(DEFAULT_STEPS))
    """The candidate's share of live traffic at each step, in percent, rising; the last is 100 (the promotion)."""
    step_min_seconds: float = 60.0
    """Each step is held at least this many seconds (and until step_min_requests)."""
    step_min_requests: int = 50
    """Each step is held until the candidate served this many live requests in it (and step_min_seconds)."""
    step_max_seconds: float = 1800.0
    """Still inconclusive after this many seconds: pause for a human."""
    shadow_seconds: float = 0.0
    """Mirror to the candidate this many seconds before the first live step (0: no shadow phase)."""
    shadow_min_requests: int = 20
    """Mirrored pairs needed to leave the shadow phase."""
    mirror_sample: float = 0.2
    """Share of baseline-served requests mirrored during live steps (for agreement), 0-1."""
    alpha: float = 0.05
    """False-alarm budget of a whole step, however often it is looked at."""
    min_samples: int = 8
    """A gate says nothing on fewer samples per side."""
    analysis_interval: float = 5.0
    """Seconds between looks at the gates."""
    gates: Gates = Gates()
    """`[models.<name>.rollout.gates]`: the thresholds the candidate must meet at each step."""

    def problems(self) -> list[str]:
        """What is wrong with it, in words a 400 can carry (empty: nothing)."""
        out = []
        if not self.steps:
            out.append("steps: at least one step")
        if any(not 0 < s <= 100 for s in self.steps):
            out.append("steps: each a percent in (0, 100]")
        if any(b <= a for a, b in zip(self.steps, self.steps[1:])):
            out.append("steps: weights must rise strictly, e.g. [1, 5, 25, 50, 100]")
        if self.steps and self.steps[-1] != 100:
            out.append("steps: the last step must be 100 (the promotion)")
        if not 0 < self.alpha < 1:
            out.append("alpha: between 0 and 1")
        if not 0 <= self.mirror_sample <= 1:
            out.append("mirror_sample: between 0 and 1")
        for name in ("step_min_seconds", "step_max_seconds", "shadow_seconds", "analysis_interval"):
            if getattr(self, name) < 0:
                out.append(f"{name}: not negative")
        known = set(Gates.__struct_fields__) - {"off"}
        if unknown := [name for name in self.gates.off if name not in known]:
            out.append(f"gates.off: unknown gates {unknown} (known: {sorted(known)})")
        if self.step_min_requests < 0 or self.shadow_min_requests < 0 or self.min_samples < 1:
            out.append("step_min_requests, shadow_min_requests: not negative; min_samples: at least 1")
        return out
