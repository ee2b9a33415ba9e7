"""Turn a batch of logits into next tokens, vLLM's order of operations:

grammar bitmask (constrained rows) → raw logprobs → min_tokens mask → penalties (repetition, frequency,
presence) → greedy argmax, or temperature → top_k → top_p → min_p → typical_p → exponential-race
sampling. Every sampling sequence draws from its own seeded generator, so its output does not depend
on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.sequence import Sequence, TokenLogprob
from engine_core.structured.bitmask import TokenBitmask


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # raw logprob of each chosen token, where asked
    top_logprobs: list[list[TokenLogprob]]


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> None:
    for row, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens:
            banned = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else list(eos_token_ids))
            if banned and seq.grammar is not None and not _allows_other_than(logits[row], banned):
                continue  # the grammar is complete and only a stop may follow: end early, not with nothing
            if banned:
                logits[row, banned] = float("-inf")


def _allows_other_than(row: torch.Tensor, banned: list[int]) -> bool:
    allowed = torch.isfinite(row)
    allowed[banned] = False
    return bool(allowed.any())


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:  # HF/TGI: every token seen in prompt or output
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
            scores = logits[row, seen]
            logits[row, seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and seq.num_output_tokens:  # OpenAI: output only
            counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.long), minlength=vocab)[:vocab]
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what each row's top_k (0: off), top_p (1: off) and min_p (0: off) exclude."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1]).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, logits.shape[1]).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the better tokens; the best is always kept
    sorted_logits = sorted_logits.masked_fill(before >= top_p.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    sorted_logits = sorted_logits.masked_fill(probs < min_p.unsqueeze(1) * probs[:, :1], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_typical_p(row: torch.Tensor, mass: float) -> torch.Tensor:
    """HF's TypicalLogitsWarper for one row: keep the tokens closest to the expected surprise."""
    logp = row.log_softmax(dim=-1)
    p = logp.exp()
    entropy = -(logp * p).nansum()
    shifted = (-logp - entropy).abs()
    order = shifted.argsort()
    cumulative = p[order].cumsum(dim=-1)
    last = min(int((cumulative < mass).sum()), row.shape[0] - 1)
    keep = order[: last + 1]
    out = torch.full_like(row, float("-inf"))
    out[keep] = row[keep]
    return out


def processed_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The temperature-scaled and truncated logits that sampling rows draw from."""
    temps = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype).unsqueeze(1)
    x = logits / temps
    top_k = torch.tensor([s.params.top_k for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs], dtype=logits.dtype)
    min_p = torch.tensor([s.params.min_p for s in seqs], dtype=logits.dtype)
    if bool((top_k > 0).any() or (top_p < 1).any() or (min_p > 0).any()):
        x = apply_top_k_top_p_min_p(x, top_k, top_p, min_p)
    for row, seq in enumerate(seqs):
        if seq.params.typical_p < 1.0:
            x[row] = apply_typical_p(x[row], seq.params.typical_p)
    return x


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids
        self.bitmask = TokenBitmask()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits: [len(seqs), vocab] in the model's dtype, one row per sequence that samples this step.
        Constrained rows are masked in place first, so every path below, the greedy one too, sees the mask."""
        self.bitmask.apply(logits, seqs, argmax_only=_plain_greedy)
        if all(_plain_greedy(s) for s in seqs):
            # the common case needs neither an fp32 copy of the logits nor anything but the argmax; max()
            # returns the same first index, and on CPU in bf16 it is ~6x faster than argmax()
            return SampleResult(logits.max(dim=-1).indices.tolist(), [None] * len(seqs), [[] for _ in seqs])
        # penalties and masks write into this copy; on the host, where each sequence's seeded generator
        # lives, so a seed draws the same tokens on any device
        logits = logits.to("cpu", torch.float32, copy=True)
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = logits.log_softmax(dim=-1) if any(want_logprobs) else None

        apply_min_tokens(logits, seqs, self.eos_token_ids)
        apply_penalties(logits, seqs)

        tokens = logits.argmax(dim=-1)
        sampling_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampling_rows:
            rows = torch.tensor(sampling_rows)
            probs = processed_logits(logits[rows], [seqs[i] for i in sampling_rows]).softmax(dim=-1)
            noise = torch.empty_like(probs)
            for j, i in enumerate(sampling_rows):
                noise[j].exponential_(generator=seqs[i].generator)
            # exponential race: argmax(p / E) with E ~ Exp(1) draws from p (no multinomial sync)
            tokens[rows] = (probs / noise.clamp_min_(1e-10)).argmax(dim=-1)

        token_list = tokens.tolist()
        chosen: list[float | None] = [None] * len(seqs)
        tops: list[list[TokenLogprob]] = [[] for _ in seqs]
        if raw_logprobs is not None:
            for i, seq in enumerate(seqs):
                n = seq.params.logprobs
                if n is None:
                    continue
                chosen[i] = float(raw_logprobs[i, token_list[i]])
                if n:
                    values, ids = raw_logprobs[i].topk(n)
                    tops[i] = [TokenLogprob(t, v) for t, v in zip(ids.tolist(), values.tolist())]
        return SampleResult(token_list, chosen, tops)


def _plain_greedy(seq: Sequence) -> bool:
    p = seq.params
    return (p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.frequency_penalty
            and not p.presence_penalty and seq.num_output_tokens >= p.min_tokens)


def prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int]) -> list[TokenLogprob]:
    """Logprob of each next prompt token given the rows of logits before it."""
    logp = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(next_token_ids, dtype=torch.long)
    values = logp[torch.arange(len(next_token_ids)), ids].tolist()
    return [TokenLogprob(t, v) for t, v in zip(next_token_ids, values)]
