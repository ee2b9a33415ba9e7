"""Each sampling parameter against a small, obviously-correct reference implementation."""

from __future__ import annotations

import math

import pytest
import torch

from engine_core.sampling.params import SamplingParams
from engine_core.sampling.sampler import Sampler, apply_penalties, processed_logits
from engine_core.sequence import Sequence


def _seq(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
         seed: int = 0) -> Sequence:
    seq = Sequence("r", prompt or [1, 2], params)
    seq.token_ids += output or []
    seq.generator = torch.Generator().manual_seed(seed)
    return seq


def reference_allowed(logits: list[float], p: SamplingParams) -> set[int]:
    """Which tokens survive temperature → top_k → top_p → min_p → typical_p, written plainly."""
    scaled = [x / p.temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    allowed = order[: p.top_k] if p.top_k else order

    def softmax(ids: list[int]) -> dict[int, float]:
        m = max(scaled[i] for i in ids)
        e = {i: math.exp(scaled[i] - m) for i in ids}
        z = sum(e.values())
        return {i: v / z for i, v in e.items()}

    probs, kept, mass = softmax(allowed), [], 0.0
    for i in allowed:  # descending order; keep until the mass before a token reaches top_p
        if mass >= p.top_p:
            break
        kept.append(i)
        mass += probs[i]
    probs = softmax(kept)
    top = max(probs.values())
    kept = [i for i in kept if probs[i] >= p.min_p * top]
    if p.typical_p < 1.0:
        probs = softmax(kept)
        entropy = -sum(q * math.log(q) for q in probs.values())
        by_typicality = sorted(kept, key=lambda i: abs(-math.log(probs[i]) - entropy))
        typical, mass = [], 0.0
        for i in by_typicality:
            typical.append(i)
            mass += probs[i]
            if mass >= p.typical_p:
                break
        kept = typical
    return set(kept)


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.8, typical_p=0.5),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_truncation_keeps_exactly_the_reference_token_set(params: SamplingParams) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 12) * 2
    got = processed_logits(logits, [_seq(params) for _ in range(4)])
    for row in range(4):
        kept = {i for i in range(12) if got[row, i] != float("-inf")}
        assert kept == reference_allowed(logits[row].tolist(), params)
        finite = got[row][got[row] != float("-inf")]
        expected = logits[row][sorted(kept)] / params.temperature
        assert torch.allclose(finite, expected)


def test_exponential_race_draws_from_the_processed_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=0.9, top_k=4)
    sampler = Sampler(eos_token_ids=())
    counts = torch.zeros(6)
    n = 4000
    for i in range(n):
        counts[sampler(logits, [_seq(params, seed=i)]).token_ids[0]] += 1
    probs = processed_logits(logits, [_seq(params)]).softmax(-1)[0]
    assert counts[4:].sum() == 0
    assert torch.allclose(counts / n, probs, atol=0.03)


def test_same_seed_same_tokens_different_seed_differs() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 500)
    params = SamplingParams(temperature=1.0)
    seq_a, seq_b = _seq(params, seed=7), _seq(params, seed=7)
    a = [Sampler(())(logits, [seq_a]).token_ids[0] for _ in range(20)]
    b = [Sampler(())(logits, [seq_b]).token_ids[0] for _ in range(20)]
    assert a == b
    seq_c = _seq(params, seed=8)
    assert a != [Sampler(())(logits, [seq_c]).token_ids[0] for _ in range(20)]


def test_repetition_penalty_follows_hf_on_prompt_and_output_tokens() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    seq = _seq(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[1, 2])
    apply_penalties(logits, [seq])
    assert logits.tolist() == [[1.0, -4.0, 0.5, -1.0, 0.5]]  # positive halved, negative doubled, 3 and 4 unseen


def test_frequency_and_presence_penalties_follow_openai_on_output_tokens_only() -> None:
    logits = torch.zeros(1, 5)
    seq = _seq(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), prompt=[4, 4], output=[1, 1, 1, 2])
    apply_penalties(logits, [seq])
    assert logits.tolist() == [[0.0, -(3 * 0.5 + 1.0), -(0.5 + 1.0), 0.0, 0.0]]


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]])
    sampler = Sampler(eos_token_ids=(2,))
    seq = _seq(SamplingParams(min_tokens=2, stop_token_ids=[3]))
    assert sampler(logits, [seq]).token_ids == [4]
    seq.token_ids += [4, 4]
    assert sampler(logits, [seq]).token_ids == [2]


def test_logprobs_are_raw_log_softmax_with_top_alternatives() -> None:
    torch.manual_seed(3)
    logits = torch.randn(2, 50)
    seqs = [_seq(SamplingParams(logprobs=3)), _seq(SamplingParams(logprobs=None))]
    result = Sampler(())(logits, seqs)
    ref = torch.log_softmax(logits[0].double(), -1)
    assert result.token_ids[0] == int(ref.argmax())
    assert result.logprobs[0] == pytest.approx(float(ref.max()), abs=1e-5)
    assert [t.token_id for t in result.top_logprobs[0]] == ref.topk(3).indices.tolist()
    assert [t.logprob for t in result.top_logprobs[0]] == pytest.approx(ref.topk(3).values.tolist(), abs=1e-5)
    assert result.logprobs[1] is None and result.top_logprobs[1] == []
