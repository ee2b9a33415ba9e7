"""`[backends.<engine>.speculative]`: which proposer drafts tokens, how many, and when to stop drafting."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts tokens, one verify pass of the model accepts a prefix of them."""

    method: str
    """The proposer: "ngram" (prompt lookup), "suffix" (an index over recent requests) or "draft_model"."""
    num_speculative_tokens: int = 5
    """Most drafts verified a step, 1-32 (vLLM requires it; 5 as its n-gram example)."""
    prompt_lookup_min: int | None = None
    """ngram: the shortest n-gram matched; the drafts follow the longest suffix n-gram in [min, max] that occurred
    earlier. vLLM's defaults: both 5 when neither is set, one mirrors the other when only one is."""
    prompt_lookup_max: int | None = None
    """ngram: the longest n-gram matched (defaults as for prompt_lookup_min)."""
    model: str | None = None
    """draft_model: a smaller model with the same tokenizer, run by this engine."""
    disable_by_batch_size: int | None = 8
    """Speculate only while fewer requests than this are running: a busy step is compute-bound, and drafts there
    cost what they save (vLLM #19254). None: always."""
    min_accepted_tokens: float = 1.0
    """Acceptance-aware: a request whose recent verify passes accepted fewer drafts than this on average (an
    exponential average) stops drafting, and tries again after a back-off that doubles each time. A pass of
    1 + 5 rows costs ~1.9x a 1-row step on a 2-core CPU (docs/benchmarks.md), so it must yield ~1.9 tokens."""
    suffix_max_tree_depth: int = 24
    """suffix: the longest match extended backwards, in tokens (SuffixDecoding's knob, vLLM's default)."""
    suffix_max_cached_requests: int = 10000
    """suffix: finished requests kept in the index (SuffixDecoding's knob, vLLM's default)."""
    suffix_min_token_prob: float = 0.1
    """suffix: drafting stops where the path's estimated probability drops below this (SuffixDecoding's knob,
    vLLM's default)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: use one of {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("num_speculative_tokens must be in [1, 32]")
        low, high = self.lookup_range()
        if not 1 <= low <= high:
            raise ValueError("prompt_lookup_min must be >= 1 and <= prompt_lookup_max")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("`model` names the draft for method = \"draft_model\", and only for it")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")
        if not 0 <= self.min_accepted_tokens <= self.num_speculative_tokens:
            raise ValueError("min_accepted_tokens must be in [0, num_speculative_tokens]")
        if self.suffix_max_tree_depth < 1 or self.suffix_max_cached_requests < 0:
            raise ValueError("suffix_max_tree_depth must be >= 1 and suffix_max_cached_requests >= 0")
        if not 0 <= self.suffix_min_token_prob <= 1:
            raise ValueError("suffix_min_token_prob must be in [0, 1]")

    def lookup_range(self) -> tuple[int, int]:
        """(prompt_lookup_min, prompt_lookup_max) with vLLM's defaults filled in."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return 5, 5
        return (low if low is not None else high), (high if high is not None else low)  # type: ignore[return-value]

    def describe(self) -> str:
        low, high = self.lookup_range()
        detail = {"ngram": f"prompt lookup n-gram {low}-{high}",
                  "suffix": f"suffix index over the last {self.suffix_max_cached_requests} requests",
                  "draft_model": f"draft model {self.model}"}[self.method]
        busy = (f", off from {self.disable_by_batch_size} running requests" if self.disable_by_batch_size
                else "")
        return f"{self.method}: up to {self.num_speculative_tokens} draft tokens a step ({detail}){busy}"
