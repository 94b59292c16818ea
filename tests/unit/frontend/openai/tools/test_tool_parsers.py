"""The tool-call extractors alone: what they read, and that how a text is cut into pieces never
changes what they emit (stream == non-stream)."""

from __future__ import annotations

import random

import pytest

from frontend.openai.tools.parsers import (
    CallArgs,
    CallStart,
    Content,
    HermesCalls,
    Llama3JsonCalls,
    NamedCall,
    RequiredCalls,
    ToolEvent,
    ToolExtractor,
)


def run(extractor: ToolExtractor, text: str, cuts: list[int]) -> list[ToolEvent]:
    events, start = [], 0
    for cut in [*cuts, len(text)]:
        events += extractor.feed(text[start:cut])
        start = cut
    return events + extractor.finish()


def joined(events: list[ToolEvent]) -> tuple[str, list[list[str]]]:
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, CallStart):
            assert e.call == len(calls)
            calls.append([e.name, ""])
        elif isinstance(e, CallArgs):
            calls[e.call][1] += e.text
    return content, calls


CASES = [
    (RequiredCalls, '[ {"name": "w\\"x", "parameters": {"c": "P}a, \\"x", "n": [1, {"a": 2}]}},'
                    '\n{"parameters": {"q": 1}, "name": "g"}, {"name": "h", "parameters": {}}]',
     ("", [['w"x', '{"c": "P}a, \\"x", "n": [1, {"a": 2}]}'], ["g", '{"q": 1}'], ["h", "{}"]])),
    (RequiredCalls, '[{"name": "f", "parameters": {"a": [1, 2', ("", [["f", '{"a": [1, 2']])),
    (NamedCall, '{"a": 1}', ("", [["f", '{"a": 1}']])),
    (NamedCall, "", ("", [["f", ""]])),
    (HermesCalls, 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
                  '<tool_call>{"name": "g", "arguments": {}}</tool_call>\n',
     ("Sure.", [["f", '{"x": 1}'], ["g", "{}"]])),
    (HermesCalls, "plain <tool text  \n", ("plain <tool text  \n", [])),
    (HermesCalls, '<tool_call>{"name": "g"}', ("", [["g", "{}"]])),  # unclosed at the end
    (HermesCalls, "<tool_call>{bad}</tool_call> after", ("<tool_call>{bad}</tool_call> after",
                                                         [])),
    (HermesCalls, '<tool_call>{"name": "g", "arguments": {}}</tool_call> then <tool_',
     (" then <tool_", [["g", "{}"]])),
    (Llama3JsonCalls, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", '
                      '"arguments": {}}', ("", [["f", '{"x": 1}'], ["g", "{}"]])),
    (Llama3JsonCalls, ' {"name": "f", "parameters": {}}\n', ("", [["f", "{}"]])),
    (Llama3JsonCalls, '{"name": "f"} trailing', ('{"name": "f"} trailing', [])),
    (Llama3JsonCalls, '{"name": 1}', ('{"name": 1}', [])),
    (Llama3JsonCalls, " <|pyth hello", (" <|pyth hello", [])),
]


@pytest.mark.parametrize(("make", "text", "expected"), CASES)
def test_extractors_read_any_cut_alike(make: type, text: str,
                                       expected: tuple[str, list[list[str]]]) -> None:
    new = (lambda: make("f")) if make is NamedCall else make
    assert joined(run(new(), text, [])) == expected
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(6, len(text) + 1)))
        assert joined(run(new(), text, cuts)) == expected, cuts
    assert joined(run(new(), text, list(range(len(text))))) == expected  # char by char


def test_hermes_streams_content_before_the_end() -> None:
    parser = HermesCalls()
    assert parser.feed("Hello <tool") == [Content("Hello")]
    assert parser.feed("box> and") == [Content(" <toolbox> and")]


def test_required_streams_arguments_as_generated() -> None:
    parser = RequiredCalls()
    assert parser.feed('[{"name": "f", "parameters": {"a') == [CallStart(0, "f"),
                                                               CallArgs(0, '{"a')]
    assert parser.feed('": 1}}]') == [CallArgs(0, '": 1}')]
