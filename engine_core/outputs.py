"""What the engine reports: one output per generated token, the last one with its finish reason."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.kv.transfer import KvHandle, KvImported
from engine_core.sequence import TokenLogprob

FINISH_LENGTH = "length"
FINISH_EOS = "eos_token"
FINISH_STOP = "stop_sequence"


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    token_id: int
    token_text: str  # this token's own text, special tokens included
    text: str  # output text released with this token (stop strings held back and cut)
    special: bool
    num_prompt_tokens: int
    num_output_tokens: int
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None
    seed: int | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first output, when asked
    num_cached_tokens: int = 0
    queue_seconds: float | None = None  # with the first output: time from arrival to first compute
    kv_handle: KvHandle | None = None  # a prefill engine's handover: the request goes on elsewhere
    kv_error: str | None = None  # the handover could not be written: the request ends here, unfinished
    kv_imported: KvImported | None = None  # a decode engine's first output: how it took the prompt's KV

    @property
    def finished(self) -> bool:
        """The last output of this request here: it finished, or was handed over (or failed to be)."""
        return self.finish_reason is not None or self.kv_handle is not None or self.kv_error is not None
