"""Property tests (hypothesis): stop-string holdback and sampling-parameter validation."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core.sampling.params import SamplingParams
from engine_core.text.stop_strings import Released, StopStringBuffer

ALPHABET = st.sampled_from("ab c\né")  # few letters: stop strings occur often
pieces = st.lists(st.text(ALPHABET, max_size=4), max_size=30)
stops = st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3)
# no per-example deadline, no 'too slow' check: hypothesis' own timing must not fail a busy machine


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=pieces, stop=stops)
def test_holdback_releases_exactly_the_text_before_the_first_stop_string(pieces: list[str], stop: list[str]) -> None:
    buffer = StopStringBuffer(stop=list(stop))
    released, matched = "", None
    for piece in pieces:
        result = buffer.push(piece)
        released += result.text
        # nothing released may ever contain a stop string
        assert not any(s in released for s in stop)
        if result.stop_string is not None:
            matched = result.stop_string
            break
    whole = "".join(pieces)
    # generation stops at the first piece after which a stop string has appeared (as vLLM checks the text as it
    # grows): a longer stop string that would have started earlier but is not complete yet does not count
    seen = next(("".join(pieces[:k]) for k in range(len(pieces) + 1) if any(s in "".join(pieces[:k]) for s in stop)),
                None)
    if seen is None:
        assert matched is None
        assert released + buffer.flush() == whole  # held back text comes out at the end
    else:
        index = min(seen.find(s) for s in stop if s in seen)
        assert matched is not None and released == whole[:index]
        assert whole[index:].startswith(matched)


def test_a_stop_string_stops_the_text_once_complete_even_if_a_longer_one_began_earlier() -> None:
    # "ac " starts before "c" but "c" completes first: the stream ends there, as vLLM's would
    buffer = StopStringBuffer(stop=["c", "ac "])
    assert buffer.push("a") == Released("")  # held back: it may begin "ac "
    assert buffer.push("c") == Released("a", "c")


VALID = {"temperature": 0.7, "top_k": 10, "top_p": 0.9, "min_p": 0.0, "typical_p": 1.0, "repetition_penalty": 1.1,
         "frequency_penalty": 0.0, "presence_penalty": 0.0, "max_new_tokens": 8, "min_tokens": 0, "logprobs": None}
RULES = {
    "temperature": lambda x: 0 <= x < math.inf, "top_k": lambda x: 0 <= x < 2**31, "top_p": lambda x: 0 < x <= 1,
    "min_p": lambda x: 0 <= x <= 1, "typical_p": lambda x: 0 < x <= 1,
    "repetition_penalty": lambda x: 0 < x < math.inf, "frequency_penalty": lambda x: -2 <= x <= 2,
    "presence_penalty": lambda x: -2 <= x <= 2, "max_new_tokens": lambda x: x >= 1,
    "min_tokens": lambda x: 0 <= x <= VALID["max_new_tokens"], "logprobs": lambda x: x is None or 0 <= x <= 20,
}
INTEGER_FIELDS = {"top_k", "max_new_tokens", "min_tokens", "logprobs"}


@st.composite
def one_field_changed(draw: st.DrawFn) -> tuple[str, object]:
    name = draw(st.sampled_from(sorted(RULES)))
    if name in INTEGER_FIELDS:
        return name, draw(st.integers(-3, 40) | st.integers(2**31 - 2, 2**64))
    return name, draw(st.floats(allow_nan=True, allow_infinity=True) | st.floats(-3, 3))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(change=one_field_changed())
def test_sampling_validation_accepts_exactly_the_valid_ranges(change: tuple[str, object]) -> None:
    name, value = change
    params = SamplingParams(**{**VALID, name: value})  # type: ignore[arg-type]
    valid = bool(RULES[name](value))
    try:
        params.validate()
    except ValueError as exc:
        assert not valid, f"refused {name}={value}: {exc}"
        assert str(exc).startswith(name), f"the message names another field: {exc}"
    else:
        assert valid, f"accepted {name}={value}"
