"""Reasoning parsers (`--reasoning-parser NAME`): a choice's text split into its thinking and its
answer, piece by piece, whatever the cuts.

A parser reads the choice's text as it grows (`feed`) and then once more at the end (`finish`);
each call returns the `Split` it can release: reasoning text, and content text. Text that could
still be the start of a marker is held back until it is decided, so the joined reasoning and the
joined content depend only on the whole text, never on how it was cut (a marker split across
steps, a multi-byte character). The markers are in neither.

Where the thinking starts is read from the rendered prompt once per request (`thinks_first`):
a template that opens `<think>` in its generation prompt (DeepSeek-R1's) makes the output
reasoning from its first character. Whatever the prompt, an output that begins with the start
marker thinks (the marker dropped). In thinking, the first end marker ends it: everything after
is content, later markers included, as text. An output that never ends its thinking is
reasoning only.

Adding a parser is a subclass naming its markers and `thinks_first`, and a line in PARSERS.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple


class Split(NamedTuple):
    """What one call releases: reasoning text and content text (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class ThinkingParser:
    """`<think>...</think>` reasoning. States: at the very start (a start marker may follow),
    thinking, answering. `ended` says whether the output reached its answer: the thinking
    ended, or there was none."""

    START: ClassVar[str] = "<think>"
    END: ClassVar[str] = "</think>"

    def __init__(self, thinking: bool) -> None:
        """`thinking`: the output starts inside the thinking (see `thinks_first`)."""
        self.thinking = thinking
        self.at_start = True  # nothing decided yet: a start marker may open the output
        self.buffer = ""  # text held back

    @classmethod
    def thinks_first(cls, prompt: str) -> bool:
        """Whether an output after this prompt starts inside the thinking."""
        raise NotImplementedError

    @classmethod
    def closed_by(cls, prompt: str) -> bool:
        """The prompt itself ended the thinking (an empty think block, as a template writes it
        when thinking is turned off): the output is the answer."""
        return prompt.rstrip().endswith(cls.END)

    @property
    def ended(self) -> bool:
        return not self.thinking and not self.at_start

    def feed(self, text: str) -> Split:
        self.buffer += text
        if self.at_start and not self._opened():
            return Split()
        if not self.thinking:
            return Split(content=self._take(len(self.buffer)))
        end = self.buffer.find(self.END)
        if end < 0:
            return Split(self._take(len(self.buffer) - _tail_starting(self.buffer, self.END)))
        reasoning = self._take(end)
        self.buffer = self.buffer[len(self.END):]
        self.thinking = False
        return Split(reasoning, self._take(len(self.buffer)))

    def finish(self) -> Split:
        """The rest: a held tail is text of the state it is in."""
        self.at_start = False
        text, self.buffer = self.buffer, ""
        return Split(text) if self.thinking else Split(content=text)

    def _opened(self) -> bool:
        """At the start: decide whether the output opens with the start marker (dropped, and
        thinking). False while the held text could still become it."""
        if self.START.startswith(self.buffer) and len(self.buffer) < len(self.START):
            return False
        self.at_start = False
        if self.buffer.startswith(self.START):
            self.buffer = self.buffer[len(self.START):]
            self.thinking = True
        return True

    def _take(self, size: int) -> str:
        """The first `size` characters of the held text, released."""
        text, self.buffer = self.buffer[:size], self.buffer[size:]
        return text


class DeepSeekR1Parser(ThinkingParser):
    """DeepSeek-R1 and its distills: the output thinks first (the template opens `<think>`, or
    the model writes it), unless the prompt closed the thinking itself."""

    @classmethod
    def thinks_first(cls, prompt: str) -> bool:
        return not cls.closed_by(prompt)


class Qwen3Parser(ThinkingParser):
    """Qwen3: the output thinks when it opens with `<think>`, or when the prompt opened it
    (Qwen3's thinking-only models' templates do); otherwise it is the answer (a template with
    thinking turned off writes an empty think block into the prompt)."""

    @classmethod
    def thinks_first(cls, prompt: str) -> bool:
        return prompt.rstrip().endswith(cls.START)


PARSERS: dict[str, type[ThinkingParser]] = {"deepseek_r1": DeepSeekR1Parser,
                                           "qwen3": Qwen3Parser}


def _tail_starting(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
