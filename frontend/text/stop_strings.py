"""Stop strings over streamed text, with holdback.

Text that could still become a stop string is held back: exactly the longest suffix of the text
seen so far that is a proper prefix of some stop string. Everything before it is released. So
nothing of a stop string ever reaches the client (unless include_stop_str_in_output), and a
match that spans chunks is always found: a match must start inside the held-back suffix.

When several stop strings complete in the same chunk, the one starting first wins; on a tie,
the one listed first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopMatch(NamedTuple):
    start: int  # index in the searched text where the stop string begins
    stop: str


class StopResult(NamedTuple):
    text: str  # text released by this call
    stop: str | None  # the stop string that matched, if one did


def find_stop(text: str, stops: Sequence[str]) -> StopMatch | None:
    """The earliest occurrence of any stop string in `text` (ties: first listed)."""
    best: StopMatch | None = None
    for stop in stops:
        start = text.find(stop)
        if start != -1 and (best is None or start < best.start):
            best = StopMatch(start, stop)
    return best


def partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class StopStringChecker:
    """Feeds streamed text through the stop strings; one per choice."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop_str_in_output
        self._held = ""
        self.matched: str | None = None

    @property
    def held(self) -> str:
        """Text withheld because it could be the start of a stop string."""
        return self._held

    def feed(self, text: str) -> StopResult:
        """Add newly final text; return what may be released and whether a stop string matched.

        After a match every further call releases nothing.
        """
        if self.matched is not None:
            return StopResult("", self.matched)
        if not self._stops:
            return StopResult(text, None)
        window = self._held + text
        match = find_stop(window, self._stops)
        if match is not None:
            self.matched = match.stop
            self._held = ""
            end = match.start + (len(match.stop) if self._include else 0)
            return StopResult(window[:end], match.stop)
        keep = partial_stop_length(window, self._stops)
        self._held = window[len(window) - keep :]
        return StopResult(window[: len(window) - keep], None)

    def flush(self) -> str:
        """At finish: release the held-back text (it did not turn into a stop string)."""
        text, self._held = self._held, ""
        return text if self.matched is None else ""
