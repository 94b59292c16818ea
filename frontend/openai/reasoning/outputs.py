"""Reasoning outputs (`--reasoning-parser NAME`, vLLM's flag): each chat choice's text split into
its thinking (`reasoning`) and its answer (`content`), and the engine told where a constrained
request's thinking ends.

- `ReasoningConfig` is the frontend's parser, settled at start-up: the parser class, the end
  marker's token ids, and whether answers also carry the old field name `reasoning_content`
  (`--reasoning-field-alias reasoning_content`).
- `ReasoningPlan` is one request's: where its output's thinking starts (read once from the
  rendered prompt) and the token ids the engine waits for before a grammar masks anything
  (`SamplingParams.reasoning_end`, sent only with a constrained request; none when the prompt
  already closed the thinking).
- `ChoiceReasoning` splits one choice's deltas: a delta in, its reasoning text and the same delta
  with only its content text out, so everything downstream (tool-call parsers, message shaping)
  reads only the content. Finish, usage and logprobs stay the delta's.

Without a parser nothing here runs, and answers carry no reasoning field at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from frontend.openai.protocol.chat import DeltaMessage, ResponseMessage
from frontend.openai.reasoning.parsers import PARSERS, ThinkingParser
from frontend.text.output_processor import ChoiceDelta

logger = logging.getLogger(__name__)

REASONING_PARSERS = tuple(PARSERS)
FIELD_ALIASES = ("reasoning_content",)  # vLLM's name before it chose `reasoning`


@dataclass(frozen=True)
class ReasoningConfig:
    """The frontend's reasoning parser and how its answers name the reasoning."""

    parser: type[ThinkingParser]
    end_ids: tuple[int, ...]  # the end marker's token ids: what the engine waits for
    alias: bool = False  # answers also carry `reasoning_content`

    @classmethod
    def load(cls, name: str, tokenizer: Any, alias: str | None = None) -> ReasoningConfig:
        parser = PARSERS[name]
        ids = tuple(tokenizer.encode(parser.END, add_special_tokens=False))
        if len(ids) != 1:
            logger.warning("--reasoning-parser %s: %r is %d tokens in this tokenizer, not one; "
                           "the engine starts a constrained answer's grammar after these %d "
                           "tokens in this order (another spelling of the marker is not seen)",
                           name, parser.END, len(ids), len(ids))
        return cls(parser, ids, alias == "reasoning_content")

    def for_prompt(self, prompt: str) -> ReasoningPlan:
        """The plan of a request whose rendered prompt is `prompt`."""
        engine_end = () if self.parser.closed_by(prompt) else self.end_ids
        return ReasoningPlan(self, self.parser.thinks_first(prompt), engine_end)


@dataclass(frozen=True)
class ReasoningPlan:
    """One request's reasoning: where its choices' thinking starts, the engine's gate."""

    config: ReasoningConfig
    thinks_first: bool
    engine_end: tuple[int, ...]  # SamplingParams.reasoning_end of a constrained request

    def choice(self) -> ChoiceReasoning:
        """A fresh splitter for one choice."""
        return ChoiceReasoning(self.config.parser(self.thinks_first), self.config.alias)


class ChoiceReasoning:
    """One choice's deltas split into reasoning and content, whatever the cuts."""

    def __init__(self, parser: ThinkingParser, alias: bool) -> None:
        self.parser = parser
        self.alias = alias
        self.reasoning = ""  # all the reasoning split so far

    @property
    def answered(self) -> bool:
        """The output reached its answer (its thinking ended, or it had none)."""
        return self.parser.ended

    def split(self, delta: ChoiceDelta, final: bool = False) -> tuple[str, ChoiceDelta]:
        """The delta's reasoning text, and the delta with its content text alone (the rest
        held back; at its finish, or when `final`, everything released)."""
        split = self.parser.feed(delta.text)
        reasoning, content = split.reasoning, split.content
        if final or delta.finish_reason is not None:
            rest = self.parser.finish()
            reasoning, content = reasoning + rest.reasoning, content + rest.content
        self.reasoning += reasoning
        return reasoning, msgspec.structs.replace(delta, text=content)

    def message(self, message: ResponseMessage) -> ResponseMessage:
        """A whole answer's message with its reasoning (null when there was none), and its
        content null when the thinking never ended."""
        if not self.answered:
            message.content = None
        message.reasoning = self.reasoning or None
        if self.alias:
            message.reasoning_content = message.reasoning
        return message

    def deltas(self, reasoning: str, messages: list[DeltaMessage]) -> list[DeltaMessage]:
        """A streamed delta's messages with its reasoning text: in the first message when that
        one carries content (its empty content then left out), else in one of its own."""
        if not reasoning:
            return messages
        alias = reasoning if self.alias else None
        first = messages[0] if messages else None
        if first is not None and first.tool_calls is None and first.role is None:
            return [msgspec.structs.replace(first, content=first.content or None,
                                            reasoning=reasoning, reasoning_content=alias),
                    *messages[1:]]
        return [DeltaMessage(reasoning=reasoning, reasoning_content=alias), *messages]
