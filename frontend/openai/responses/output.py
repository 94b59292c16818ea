"""One answer's deltas as Responses output items, and the stream events that build them.

`OutputItems` takes the choice's deltas in order (a non-streamed answer: all of them merged, in
one call) and keeps its output items: a `reasoning` item (with a reasoning parser), `message`
items with one `output_text` part, and `function_call` items, in the order the answer produced
them. Each call returns the events that the new text adds, in OpenAI's order: an item is
`output_item.added` when its first text comes (a message or reasoning item with its
`content_part.added`), gets `.delta` events, and is closed (`.done` events, then
`output_item.done`) when the next item starts or the answer ends. The events depend only on
what was produced, not on how it was cut, but for how the deltas are grouped: the joined deltas
equal the items.

The reasoning parser reads the text first; tool calls are read from the content alone: the
tool plan's extractor (`tools/parsers.py`) turns it into content, call starts and argument
fragments. Without tools, all content is message text.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from frontend.openai.reasoning.outputs import ChoiceReasoning
from frontend.openai.responses.protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionCallItem,
    ItemStatus,
    MessageItem,
    OutputItem,
    OutputItemEvent,
    OutputText,
    ReasoningItem,
    ReasoningText,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from frontend.openai.tools.calls import ToolPlan
from frontend.openai.tools.parsers import CallArgs, CallStart, Content, ToolEvent, ToolExtractor
from frontend.text.output_processor import ChoiceDelta


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """One answer's output items, built as its deltas come (see the module docstring)."""

    def __init__(self, reasoning: ChoiceReasoning | None, tools: ToolPlan) -> None:
        self.reasoning = reasoning
        self.extractor: ToolExtractor | None = tools.extractor() if tools.active else None
        self.parallel = tools.parallel
        self.items: list[OutputItem] = []
        self.open = False  # the last item is still growing
        self.parts: list[str] = []  # the open item's text so far
        self.token_ids: list[int] = []  # every generated token released
        self.finish_reason: str | None = None
        self._calls: dict[int, int] = {}  # a call's index in the answer -> its output index

    @property
    def incomplete(self) -> bool:
        """The answer was cut by its token budget (or the context)."""
        return self.finish_reason == "length"

    def reasoning_tokens(self, end: Sequence[int]) -> int:
        """The generated tokens the thinking took: through its end marker's `end` ids, or all
        of them when it never ended; 0 without a reasoning item."""
        if not any(isinstance(item, ReasoningItem) for item in self.items):
            return 0
        ids, end = self.token_ids, list(end)
        for k in range(len(ids) - len(end) + 1 if end else 0):
            if ids[k:k + len(end)] == end:
                return k + len(end)
        return len(ids)

    def feed(self, delta: ChoiceDelta, final: bool = False) -> list[StreamEvent]:
        """The events of one delta (the last one: `final`, or it has a finish reason)."""
        final = final or delta.finish_reason is not None
        self.token_ids += delta.token_ids
        events: list[StreamEvent] = []
        if self.reasoning is not None:
            thought, delta = self.reasoning.split(delta, final)
            if thought:
                self._text(ReasoningItem, thought, events)
        for piece in self._read(delta.text, final):
            if isinstance(piece, Content):
                if piece.text:
                    self._text(MessageItem, piece.text, events)
            elif self.parallel or piece.call == 0:
                self._call(piece, events)
        if final:
            self.finish_reason = delta.finish_reason
            if self.open:
                self._close("incomplete" if self.incomplete else "completed", events)
        return events

    def _read(self, text: str, final: bool) -> Sequence[ToolEvent]:
        if self.extractor is None:
            return [Content(text)]
        return self.extractor.feed(text) + (self.extractor.finish() if final else [])

    def _text(self, kind: type[MessageItem] | type[ReasoningItem], text: str,
              events: list[StreamEvent]) -> None:
        """Text for a message or reasoning item: the open one if it is of that kind, else a
        new one."""
        if not (self.open and isinstance(self.items[-1], kind)):
            self._start(kind(id=new_id("msg" if kind is MessageItem else "rs"), content=[],
                             status="in_progress"), events)
            part = OutputText(text="") if kind is MessageItem else ReasoningText(text="")
            events.append(self._part_event("added", part))
        item = self.items[-1]
        self.parts.append(text)
        name = "output_text" if kind is MessageItem else "reasoning_text"
        events.append(TextDeltaEvent(
            type=f"response.{name}.delta", item_id=item.id, output_index=len(self.items) - 1,
            content_index=0, delta=text, logprobs=_logprobs(kind)))

    def _call(self, piece: CallStart | CallArgs, events: list[StreamEvent]) -> None:
        if isinstance(piece, CallStart):
            self._calls[piece.call] = len(self.items)
            self._start(FunctionCallItem(id=new_id("fc"), call_id=new_id("call"),
                                         name=piece.name, arguments="",
                                         status="in_progress"), events)
            return
        index = self._calls[piece.call]
        item = self.items[index]
        assert isinstance(item, FunctionCallItem)
        item.arguments += piece.text
        events.append(ArgumentsDeltaEvent(type="response.function_call_arguments.delta",
                                          item_id=item.id, output_index=index,
                                          delta=piece.text))

    def _start(self, item: OutputItem, events: list[StreamEvent]) -> None:
        if self.open:
            self._close("completed", events)
        self.items.append(item)
        self.open, self.parts = True, []
        events.append(OutputItemEvent(type="response.output_item.added",
                                      output_index=len(self.items) - 1, item=_copy(item)))

    def _close(self, status: ItemStatus, events: list[StreamEvent]) -> None:
        item, index = self.items[-1], len(self.items) - 1
        item.status = status
        self.open = False
        if isinstance(item, FunctionCallItem):
            events.append(ArgumentsDoneEvent(type="response.function_call_arguments.done",
                                             item_id=item.id, output_index=index,
                                             name=item.name, arguments=item.arguments))
        else:
            text = "".join(self.parts)
            if isinstance(item, MessageItem):
                item.content = [OutputText(text=text)]
                name = "output_text"
            else:
                item.content = [ReasoningText(text=text)]
                name = "reasoning_text"
            events.append(TextDoneEvent(type=f"response.{name}.done", item_id=item.id,
                                        output_index=index, content_index=0, text=text,
                                        logprobs=_logprobs(type(item))))
            events.append(self._part_event("done", item.content[0]))
        events.append(OutputItemEvent(type="response.output_item.done", output_index=index,
                                      item=_copy(item)))

    def _part_event(self, what: str, part: OutputText | ReasoningText) -> ContentPartEvent:
        item = self.items[-1]
        return ContentPartEvent(type=f"response.content_part.{what}", item_id=item.id,
                                output_index=len(self.items) - 1, content_index=0, part=part)


def _logprobs(kind: type[OutputItem]) -> list[Any] | msgspec.UnsetType:
    """Output text events carry logprobs (none are asked here); reasoning text events none."""
    return [] if kind is MessageItem else msgspec.UNSET


def _copy(item: OutputItem) -> OutputItem:
    """The item as it is now (the item itself keeps growing)."""
    return msgspec.structs.replace(item)
