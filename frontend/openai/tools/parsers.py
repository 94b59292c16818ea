"""Tool calls read out of a chat choice's text as it grows: one extractor per choice.

Every extractor takes the choice's text piece by piece (`feed`) and then once `finish`es; both
return `ToolEvent`s in order: content text, the start of call i (its function's name), and
fragments of call i's arguments (a JSON text). A non-streamed answer feeds the whole text at
once, a streamed one each delta's text, and both join the same events: an extractor's output
depends only on the concatenated text, never on how it was cut.

- `NamedCall` (tool_choice names a function): the whole output is that function's arguments.
- `RequiredCalls` (tool_choice "required"): the output is `[{"name": ..., "parameters": {...}},
  ...]`; each call starts once its name is read, and its arguments stream as they are generated
  (the raw text of its "parameters" value).
- `HermesCalls` (`--tool-call-parser hermes`): `<tool_call>{"name", "arguments"}</tool_call>`
  blocks, each emitted once closed; the text around them is content.
- `Llama3JsonCalls` (`--tool-call-parser llama3_json`): the whole output, after an optional
  `<|python_tag|>`, is `{"name", "parameters"}` objects separated by `;`, or it is all content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol


class Content(NamedTuple):
    text: str


class CallStart(NamedTuple):
    call: int  # the call's index in the answer
    name: str


class CallArgs(NamedTuple):
    call: int
    text: str


ToolEvent = Content | CallStart | CallArgs


class ToolExtractor(Protocol):
    """One choice's text in, events out (see the module docstring)."""

    def feed(self, text: str) -> list[ToolEvent]: ...

    def finish(self) -> list[ToolEvent]: ...


class NamedCall:
    """tool_choice names `name`: one call, whose arguments are the whole (constrained) output."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> list[ToolEvent]:
        events = self._start()
        if text:
            events.append(CallArgs(0, text))
        return events

    def finish(self) -> list[ToolEvent]:
        return self._start()

    def _start(self) -> list[ToolEvent]:
        if self.started:
            return []
        self.started = True
        return [CallStart(0, self.name)]


class RequiredCalls:
    """tool_choice "required": scans the constrained JSON array character by character.

    Inside an element object (depth 2) it reads keys; the "name" string's value starts a call,
    and the characters of the "parameters" value are that call's arguments (held until the
    name is known, should the parameters come first)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.calls = -1  # index of the current element
        self._new_element()

    def _new_element(self) -> None:
        self.key: str | None = None  # the last key read in the element
        self.expect_value = False  # after the key's colon
        self.token = ""  # a string being read at depth 2 (a key or a value)
        self.in_args = False  # reading the "parameters" value
        self.args_container = False  # that value is an object or array (not a scalar)
        self.named = False
        self.pending = ""  # arguments read before the name

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        for char in text:
            self._step(char, events)
        return _merge_args(events)

    def finish(self) -> list[ToolEvent]:
        return []

    def _step(self, char: str, events: list[ToolEvent]) -> None:
        before, was_string = self.depth, self.in_string
        self._lex(char)
        if self.in_args:
            if self.args_container and not was_string and self.depth == 2:
                self.in_args = False  # the value's closing bracket, still part of it
            elif not self.args_container and not was_string and before == 2 and char in ",}":
                self.in_args = False  # a scalar ended by what follows it
            if self.in_args or self.args_container:
                self._args(char, events)
                return
        if before == 1 and self.depth == 2:
            self.calls += 1
            self._new_element()
        elif before == 2:
            self._structure(char, was_string, events)

    def _structure(self, char: str, was_string: bool, events: list[ToolEvent]) -> None:
        """A character at depth 2 outside the arguments: keys, colons, commas, the name."""
        if (not was_string and self.key == "parameters" and self.expect_value
                and not char.isspace() and char not in ",}"):
            self.in_args, self.args_container = True, char in "[{"
            self._args(char, events)
        elif was_string or char == '"':
            self.token += char
            if was_string and not self.in_string:  # the closing quote
                self._string_done(json.loads(self.token), events)
                self.token = ""
        elif char == ":":
            self.expect_value = True
        elif char == ",":
            self.key, self.expect_value = None, False

    def _lex(self, char: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "[{":
            self.depth += 1
        elif char in "]}":
            self.depth -= 1

    def _string_done(self, value: str, events: list[ToolEvent]) -> None:
        if not self.expect_value:
            self.key = value
        elif self.key == "name" and not self.named:
            self.named = True
            events.append(CallStart(self.calls, value))
            if self.pending:
                events.append(CallArgs(self.calls, self.pending))

    def _args(self, text: str, events: list[ToolEvent]) -> None:
        if self.named:
            events.append(CallArgs(self.calls, text))
        else:
            self.pending += text


def _merge_args(events: list[ToolEvent]) -> list[ToolEvent]:
    """Adjacent argument characters of one call as one fragment."""
    merged: list[ToolEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, CallArgs) and isinstance(last, CallArgs) and last.call == event.call:
            merged[-1] = CallArgs(event.call, last.text + event.text)
        else:
            merged.append(event)
    return merged


def call_events(index: int, obj: Any, args_key: str) -> list[ToolEvent] | None:
    """A parsed call object as its events, or None when it is not one: a dict with a string
    "name" and a dict of arguments under `args_key` (or the other of arguments/parameters)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    other = "parameters" if args_key == "arguments" else "arguments"
    args = obj.get(args_key, obj.get(other, {}))
    if not isinstance(args, dict):
        return None
    return [CallStart(index, obj["name"]), CallArgs(index, json.dumps(args, ensure_ascii=False))]


class HermesCalls:
    """`<tool_call>JSON</tool_call>` blocks. Content is streamed as it comes, but for a tail that
    could open a block and whitespace (the whitespace next to a call is dropped); a block that
    is not a call (bad JSON, no name) is content as written; an unclosed block is read at the
    end like a closed one."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buffer = ""  # text not yet emitted
        self.in_call = False
        self.calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        self.buffer += text
        events: list[ToolEvent] = []
        while self._advance(events):
            pass
        return events

    def finish(self) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if self.in_call:
            self._block(self.buffer, self.OPEN + self.buffer, events)
        elif self.buffer and (self.calls == 0 or self.buffer.strip()):
            events.append(Content(self.buffer))
        self.buffer = ""
        return events

    def _advance(self, events: list[ToolEvent]) -> bool:
        """Emit what is final in the buffer; True when a marker was passed (loop again)."""
        if self.in_call:
            end = self.buffer.find(self.CLOSE)
            if end < 0:
                return False
            self._block(self.buffer[:end], self.OPEN + self.buffer[: end + len(self.CLOSE)],
                        events)
            self.buffer, self.in_call = self.buffer[end + len(self.CLOSE):], False
            return True
        start = self.buffer.find(self.OPEN)
        if start >= 0:
            before = self.buffer[:start]
            if before.strip():
                events.append(Content(before.rstrip()))
            self.buffer, self.in_call = self.buffer[start + len(self.OPEN):], True
            return True
        keep = _held_tail(self.buffer, self.OPEN)
        if self.buffer[:keep].strip():
            events.append(Content(self.buffer[:keep]))
            self.buffer = self.buffer[keep:]
        return False

    def _block(self, body: str, raw: str, events: list[ToolEvent]) -> None:
        try:
            call = call_events(self.calls, json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            events.append(Content(raw))
            return
        events.extend(call)
        self.calls += 1


def _held_tail(text: str, marker: str) -> int:
    """Where the text to hold back starts: trailing whitespace, and a tail that may begin
    `marker` (with the whitespace before it)."""
    cut = len(text)
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            cut = len(text) - size
            break
    return len(text[:cut].rstrip())


class Llama3JsonCalls:
    """Llama 3's JSON calls: decided at the end when the output opens like a call (`{` or
    `<|python_tag|>` after whitespace); otherwise content streamed as it comes."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.buffer = ""
        self.mode: str | None = None  # None: undecided, "calls": held to the end, "content"

    def feed(self, text: str) -> list[ToolEvent]:
        if self.mode == "content":
            return [Content(text)] if text else []
        self.buffer += text
        head = self.buffer.lstrip()
        if head.startswith(("{", self.TAG)):
            self.mode = "calls"
        elif head and not self.TAG.startswith(head):
            self.mode = "content"
            text, self.buffer = self.buffer, ""
            return [Content(text)]
        return []

    def finish(self) -> list[ToolEvent]:
        text, self.buffer = self.buffer, ""
        if not text:
            return []
        calls = parse_llama3_calls(text) if self.mode == "calls" else None
        return [Content(text)] if calls is None else calls


def parse_llama3_calls(text: str) -> list[ToolEvent] | None:
    """`[<|python_tag|>]{call}[; {call}]...`, the whole text; None when it is not that."""
    rest = text.lstrip().removeprefix(Llama3JsonCalls.TAG)
    decoder = json.JSONDecoder()
    events: list[ToolEvent] = []
    while True:
        rest = rest.lstrip()
        try:
            obj, end = decoder.raw_decode(rest)
        except ValueError:
            return None
        call = call_events(len(events) // 2, obj, "parameters")
        if call is None:
            return None
        events.extend(call)
        rest = rest[end:].lstrip()
        if not rest:
            return events
        if not rest.startswith(";"):
            return None
        rest = rest[1:]


AUTO_PARSERS: dict[str, Callable[[], ToolExtractor]] = {
    "hermes": HermesCalls, "llama3_json": Llama3JsonCalls}
