"""The reasoning parsers over adversarial cuts: fed piece by piece (markers split anywhere,
multi-byte text, marker look-alikes), they release what a whole-text reference split gives, and
where the thinking starts is read from the prompt."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from frontend.openai.reasoning.parsers import (
    PARSERS,
    DeepSeekR1Parser,
    Qwen3Parser,
    ThinkingParser,
)

R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n"
PIECES = ["<think>", "</think>", "<", "</", "<th", "</think", "think>", ">", "a", " ", "\n",
          "思", "考", "é", "🙂", "<thinking>", "</thin", "k>"]


def reference(text: str, thinking: bool) -> tuple[str, str | None]:
    """The whole text's split, written plainly: (reasoning, content or None when the thinking
    never ended)."""
    if text.startswith("<think>"):
        text, thinking = text[len("<think>"):], True
    if not thinking:
        return "", text
    reasoning, marker, content = text.partition("</think>")
    return reasoning, content if marker else None


def parse(parser: ThinkingParser, pieces: list[str]) -> tuple[str, str | None]:
    reasoning, content = "", ""
    for piece in pieces:
        split = parser.feed(piece)
        reasoning, content = reasoning + split.reasoning, content + split.content
    split = parser.finish()
    reasoning, content = reasoning + split.reasoning, content + split.content
    return reasoning, content if parser.ended else None


def cut(text: str, at: list[int]) -> list[str]:
    bounds = [0, *sorted({a % (len(text) + 1) for a in at}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("parser", list(PARSERS.values()))
@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12), st.lists(st.integers(0, 200), max_size=8),
       st.booleans())
@example(["</thin", "k>", "a"], [3], True)
@example(["<th", "ink>", "x", "</think>", "y"], [1, 2, 3, 4, 5, 6, 7], False)
def test_any_cut_releases_the_whole_texts_split(parser, pieces, at, thinking):
    """Each parser, starting in the thinking or not (what its `thinks_first` decides)."""
    text = "".join(pieces)
    expected = reference(text, thinking)
    assert parse(parser(thinking), [text]) == expected
    assert parse(parser(thinking), cut(text, at)) == expected
    assert parse(parser(thinking), list(text)) == expected  # a character a step


def test_what_is_held_back_and_released():
    p = DeepSeekR1Parser(thinking=True)
    assert p.feed("step one </thi") == ("step one ", "")  # could be the marker: held
    assert p.feed("nk>\n\n{") == ("", "\n\n{")
    assert p.feed("</think>") == ("", "</think>")  # after the answer began: text
    assert p.finish() == ("", "") and p.ended
    p = Qwen3Parser(thinking=False)
    assert p.feed("<thi") == ("", "") and not p.ended  # the start marker may be coming
    assert p.feed("s is not it") == ("", "<this is not it") and p.ended


def test_a_held_tail_is_text_at_the_end():
    p = DeepSeekR1Parser(thinking=True)
    assert p.feed("a </") == ("a ", "")
    assert p.finish() == ("</", "") and not p.ended  # reasoning only: no answer
    assert parse(Qwen3Parser(thinking=False), ["<th"]) == ("", "<th")
    assert parse(DeepSeekR1Parser(thinking=True), []) == ("", None)


@pytest.mark.parametrize(("prompt", "r1", "qwen3"), [
    (R1_PROMPT, True, True),  # the template opened the thinking
    ("<|im_start|>assistant\n", True, False),  # no marker: R1 thinks, Qwen3 answers unless
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False, False),  # it opens <think>
    ("user: what is </think> for?<|im_start|>assistant\n<think>\n", True, True),
])
def test_where_the_thinking_starts_is_read_from_the_prompt(prompt, r1, qwen3):
    assert DeepSeekR1Parser.thinks_first(prompt) is r1
    assert Qwen3Parser.thinks_first(prompt) is qwen3


def test_every_parser_is_registered_by_its_vllm_name():
    assert PARSERS == {"deepseek_r1": DeepSeekR1Parser, "qwen3": Qwen3Parser}
