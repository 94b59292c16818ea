"""JSON schema grammars (engine_core/structured/grammar.py) on a vocabulary of single characters: a
string with minLength/maxLength holds JSON characters only, each escape counted as one."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar

from engine_core.structured.grammar import json_schema_grammar

VOCAB = [chr(c) for c in range(128)] + ["é", "</s>"]
EOS = len(VOCAB) - 1
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["s"],
          "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 3}}}


@pytest.fixture(scope="module")
def compiled() -> xgrammar.CompiledGrammar:
    info = xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    grammar = json_schema_grammar(json.dumps(SCHEMA), True, any_whitespace=False)
    return xgrammar.GrammarCompiler(info, max_threads=1).compile_grammar(grammar)


def complete(compiled: xgrammar.CompiledGrammar, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return bool(matcher.accept_string(text) and matcher.is_terminated())


@pytest.mark.parametrize("value", ["ab", "a\\tb", '\\"\\\\', "\\u00e9\\n", "éé", "a\x7f"])
def test_a_bounded_string_takes_json_characters_and_escapes(compiled, value):
    text = f'{{"s": "{value}"}}'
    assert complete(compiled, text)
    jsonschema.validate(json.loads(text), SCHEMA)  # strict: no raw control character


@pytest.mark.parametrize("value", [
    "a\tb", "a\x01", "ab\x1f",  # raw control characters: not JSON (xgrammar 0.2.9 allows them)
    "\\ud83d", "a\\ude00",  # a surrogate would count as a character of its own
    "a", "abcd", "\\t\\t\\t\\t",  # out of bounds, an escape counted as one character
    "a\\q",  # no such escape
])
def test_a_bounded_string_refuses_what_json_or_its_bounds_refuse(compiled, value):
    assert not complete(compiled, f'{{"s": "{value}"}}')


def allows_tab(matcher: xgrammar.GrammarMatcher) -> bool:
    bitmask = xgrammar.allocate_token_bitmask(1, len(VOCAB))
    matcher.fill_next_token_bitmask(bitmask)
    return bool(int(bitmask[0, 0]) >> ord("\t") & 1)


def test_the_mask_allows_a_tab_between_json_tokens_only(compiled):
    inside = xgrammar.GrammarMatcher(compiled)
    assert inside.accept_string('{"s": "a') and not allows_tab(inside)
    info = xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    any_space = json_schema_grammar(json.dumps(SCHEMA), True, any_whitespace=True)
    between = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_grammar(any_space))
    assert between.accept_string("{") and allows_tab(between)


def ids(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def test_forks_follow_the_drafts_the_grammar_allows_and_leave_it_as_it_was(compiled):
    """Speculative decoding's forks (RequestGrammar.forks): one per draft prefix, each its own
    matcher; a refused draft, or one that ends the grammar, is the limit; `adopt` takes a
    fork's state."""
    from concurrent.futures import Future

    from engine_core.structured.grammar import RequestGrammar

    done: Future[xgrammar.CompiledGrammar] = Future()
    done.set_result(compiled)
    grammar = RequestGrammar(done)
    assert grammar.accept(ids('{"s": "')[0])
    forks, limit = grammar.forks(ids('"s": "ab'))
    assert limit == 8 and len(forks) == 9
    forks, limit = grammar.forks(ids('"s": 1'))  # "1" is refused: the drafts before it count
    assert limit == 5 and len(forks) == 6
    assert [f.accept(ids("1")[0]) for f in forks] == [False] * 6
    assert forks[5].accept(ids('"')[0]) and not forks[4].accept(ids('"')[0])  # own matchers
    forks, limit = grammar.forks(ids('"s": "ab"}') + [EOS, ids("x")[0]])
    assert limit == 10  # EOS ends the grammar: it is not accepted as a draft
    grammar.adopt(forks[10])
    assert not grammar.terminated and grammar.accept(EOS) and grammar.terminated
