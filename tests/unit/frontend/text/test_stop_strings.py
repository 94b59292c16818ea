"""Stop-string matching with holdback (pure, no tokenizer)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.text.stop_strings import StopStringChecker, find_stop, partial_stop_length


def feed_all(checker: StopStringChecker, chunks: list[str]) -> tuple[list[str], str | None]:
    released = []
    for chunk in chunks:
        result = checker.feed(chunk)
        released.append(result.text)
        if result.stop is not None:
            return released, result.stop
    released.append(checker.flush())
    return released, None


def test_find_stop_takes_the_earliest_then_the_first_listed() -> None:
    assert find_stop("say hello world", ["world", "hello"]) == (4, "hello")
    assert find_stop("abc", ["bc", "b"]) == (1, "bc")
    assert find_stop("abc", ["b", "bc"]) == (1, "b")
    assert find_stop("abc", ["x"]) is None


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("Hello S", ["STOP"], 1),
        ("Hello ST", ["STOP"], 2),
        ("Hello STO", ["STOP", "TOE"], 3),
        ("Hello", ["STOP"], 0),
        ("aaa", ["aab"], 2),
        ("xSTOP", ["STOP"], 0),  # a whole stop string is a match, not a prefix
        ("ab", ["b", "bcd"], 1),
        ("", ["STOP"], 0),
    ],
)
def test_partial_stop_length(text: str, stops: list[str], expected: int) -> None:
    assert partial_stop_length(text, stops) == expected


@given(st.text("ab", max_size=8), st.lists(st.text("ab", min_size=1, max_size=4), max_size=3))
def test_partial_stop_length_is_the_longest_proper_prefix_suffix(
    text: str, stops: list[str]
) -> None:
    brute = max(
        (n for s in stops for n in range(1, len(s)) if n <= len(text) and text.endswith(s[:n])),
        default=0,
    )
    assert partial_stop_length(text, stops) == brute


def test_stop_spanning_chunks_is_cut_and_never_released() -> None:
    checker = StopStringChecker(["STOP"])
    released, stop = feed_all(checker, ["Hello S", "T", "OP and more"])
    assert released == ["Hello ", "", ""]
    assert stop == "STOP" and checker.matched == "STOP"
    assert checker.feed("later").text == ""


def test_include_stop_str_in_output() -> None:
    released, stop = feed_all(StopStringChecker(["STOP"], True), ["Hello S", "TOP more"])
    assert "".join(released) == "Hello STOP"
    assert stop == "STOP"


def test_held_text_is_released_when_it_stops_being_a_prefix() -> None:
    checker = StopStringChecker(["STOP"])
    assert checker.feed("Hello ST").text == "Hello "
    assert checker.held == "ST"
    assert checker.feed("AR").text == "STAR"
    assert checker.held == ""


def test_unmatched_held_text_is_flushed_at_finish() -> None:
    released, stop = feed_all(StopStringChecker(["STOP"]), ["end ST"])
    assert released == ["end ", "ST"] and stop is None


def test_no_stop_strings_release_everything() -> None:
    checker = StopStringChecker([""])  # an empty stop string never matches
    assert checker.feed("abc").text == "abc"
    assert checker.flush() == ""


@settings(max_examples=200, deadline=None)
@given(
    text=st.text("abc ", max_size=16),
    stops=st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 16), max_size=6),
    include=st.booleans(),
)
def test_released_text_is_the_text_cut_at_a_stop(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    chunks = [text[a:b] for a, b in pairwise(bounds)]
    released, stop = feed_all(StopStringChecker(stops, include), chunks)
    # Oracle: the first chunk end by which some stop string is complete decides; there the
    # earliest-starting complete occurrence wins.
    expected = next((m for b in bounds[1:] if (m := find_stop(text[:b], stops))), None)
    out = "".join(released)
    if expected is None:
        assert stop is None and out == text
    else:
        assert stop == expected.stop
        assert out == text[: expected.start] + (expected.stop if include else "")
