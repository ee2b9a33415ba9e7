"""Per-request sampling and output options (vLLM's names, TGI's and OpenAI's semantics)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine_core.structured.params import StructuredOutputsParams

INT32_MAX = 2**31 - 1  # TGI's top_k is an i32; torch needs it to fit anyway
UINT64_MAX = 2**64 - 1  # the widest seed torch.Generator takes


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0  # HF/TGI: divides positive logits of seen tokens (prompt and output)
    frequency_penalty: float = 0.0  # OpenAI: subtracts count * penalty for output tokens
    presence_penalty: float = 0.0  # OpenAI: subtracts penalty once per output token seen
    seed: int | None = None
    max_new_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # None: no logprobs; n: chosen token plus the top n alternatives
    prompt_logprobs: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # the output must match this constraint
    adapter: str | None = None  # the name of a loaded LoRA adapter; None: the base model
    speculative: bool = True  # False: never draft for this request, where the engine speculates

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 <= self.top_k <= INT32_MAX, f"top_k must be in [0, {INT32_MAX}]"),
            (self.seed is None or 0 <= self.seed <= UINT64_MAX, f"seed must be in [0, {UINT64_MAX}]"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (0 < self.typical_p <= 1, "typical_p must be in (0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (0 <= self.min_tokens <= self.max_new_tokens, "min_tokens must be in [0, max_new_tokens]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
