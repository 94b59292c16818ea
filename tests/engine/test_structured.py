"""Structured outputs on the real tiny model, in-process: the random-weight model emits gibberish
unconstrained, so every valid output below is the grammar's doing.

- Every output that finishes "stop" is complete: JSON parses and validates against its schema
  (`jsonschema`, independent of the grammar engine), a regex full-matches (Python's `re`), a
  choice is one of the choices, a grammar's output parses; a "length" output is a prefix the
  grammar accepts.
- Every token is one its mask allowed; greedy = argmax of the raw logits under the mask, and
  logprobs are the raw model's.
- Preemption, a blocked compiler, refusals and a mixed burst leave nothing behind.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import xgrammar
from transformers import AutoTokenizer

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from shared.messages import FinishReason, SamplingParams, StructuredOutput
from tests.engine.driver import Collected, run

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "additionalProperties": False, "required": ["user"],
     "properties": {"user": {"type": "object", "additionalProperties": False,
                             "required": ["id", "name"],
                             "properties": {"id": {"type": "integer"},
                                            "name": {"type": "string", "maxLength": 8}}}}},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 1, "maxItems": 4},
    {"type": "object", "additionalProperties": False, "required": ["color", "n"],
     "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "number"}}},
    {"type": "object", "required": ["code"],
     "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}},
    {"type": "object", "additionalProperties": False, "required": ["x", "k"],
     "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1},
                    "k": {"type": "integer", "minimum": 10, "maximum": 20}}},
    {"type": "object", "additionalProperties": False, "required": ["ok"],
     "properties": {"ok": {"type": "boolean"},
                    "note": {"type": ["string", "null"], "maxLength": 5}}},
    {"type": "array", "maxItems": 2,
     "items": {"type": "object", "additionalProperties": False, "required": ["k", "v"],
               "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer"}}}},
]
REGEX = r"[A-Z][a-z]{1,6}-\d{2,4}(\.[a-z]{2})?"
CHOICES = ["yes", "no", "maybe so", "naïve \"quoted\""]
GRAMMAR = 'root ::= term ("+" term)*\nterm ::= [0-9]+ | "(" root ")"'
SAMPLINGS = [dict(temperature=0.0), dict(temperature=0.8, seed=1),
             dict(temperature=1.0, seed=2, top_p=0.9), dict(temperature=1.5, seed=3, top_k=50)]


@pytest.fixture(scope="module")
def core(tiny_llama: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=512, max_model_len=512))


@pytest.fixture(scope="module")
def tok(tiny_llama: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama))


@pytest.fixture(scope="module")
def prompt(tok: Any) -> list[int]:
    return list(tok("Answer in the requested format:").input_ids)


def json_constraint(schema: dict[str, Any], any_whitespace: bool = True) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema), any_whitespace)


def text_of(tok: Any, result: Collected) -> str:
    return str(tok.decode(result.token_ids, skip_special_tokens=True))


def accepted_prefix(core: EngineCore, constraint: StructuredOutput, tokens: list[int]) -> bool:
    """Whether a fresh matcher of the constraint allows (its mask) and accepts every one of
    `tokens`."""
    grammar = core.grammars.grammar_for(constraint)
    grammar.wait(30)
    bitmask = xgrammar.allocate_token_bitmask(1, core.facts.vocab_size)
    for t in tokens:
        grammar.matcher.fill_next_token_bitmask(bitmask)
        if not (int(bitmask[0, t // 32]) >> (t % 32)) & 1 or not grammar.accept(t):
            return False
    return True


def assert_complete_or_prefix(core: EngineCore, constraint: StructuredOutput, result: Collected,
                              complete: Any) -> None:
    """"stop": `complete()` checks the whole output; "length": the output is a prefix."""
    assert result.finish in ("stop", "length"), result
    assert accepted_prefix(core, constraint, result.token_ids)
    if result.finish == "stop":
        assert result.token_ids[-1] in core.facts.eos_token_ids
        complete()


def test_json_schemas_validate_across_seeds_and_temperatures(core, tok, prompt):
    requests = {}
    for i, schema in enumerate(SCHEMAS):
        for j, sampling in enumerate(SAMPLINGS):
            rid = f"s{i}-{j}"
            requests[rid] = (schema, json_constraint(schema, any_whitespace=j % 2 == 0))
            core.add_request(rid, prompt, SamplingParams(max_tokens=160, **sampling,
                                                         structured=requests[rid][1]))
    results = run(core)
    stops = 0
    for rid, (schema, constraint) in requests.items():
        result = results[rid]
        text = text_of(tok, result)

        def complete(text: str = text, schema: dict[str, Any] = schema) -> None:
            jsonschema.validate(json.loads(text), schema)

        assert_complete_or_prefix(core, constraint, result, complete)
        stops += result.finish == "stop"
    assert stops >= len(requests) * 3 // 4  # bounded whitespace lets most of them finish
    assert core.blocks.num_free_blocks == core.blocks.num_blocks


def test_json_object_regex_choice_and_grammar(core, tok, prompt):
    checks = {
        "json_object": (StructuredOutput("json_object"),
                        lambda t: isinstance(json.loads(t), dict)),
        "regex": (StructuredOutput("regex", REGEX), lambda t: re.fullmatch(REGEX, t)),
        "choice": (StructuredOutput("choice", json.dumps(CHOICES)), lambda t: t in CHOICES),
        "grammar": (StructuredOutput("grammar", GRAMMAR), lambda t: _arithmetic(t)),
    }
    for kind, (constraint, _) in checks.items():
        for j, sampling in enumerate(SAMPLINGS):
            core.add_request(f"{kind}-{j}", prompt, SamplingParams(max_tokens=120, **sampling,
                                                                   structured=constraint))
    results = run(core)
    for kind, (constraint, check) in checks.items():
        for j in range(len(SAMPLINGS)):
            result = results[f"{kind}-{j}"]
            text = text_of(tok, result)
            assert_complete_or_prefix(core, constraint, result,
                                      lambda text=text, check=check: _truthy(check(text), text))
            if kind in ("regex", "choice"):
                assert result.finish == "stop", (kind, text)


def _truthy(value: Any, text: str) -> None:
    assert value, text


def _arithmetic(text: str) -> bool:
    """Whether `text` is in GRAMMAR's language (sums of numbers, parenthesised), by a parser
    of the test's own."""
    def term(i: int) -> int:
        if i < len(text) and text[i] == "(":
            i = expr(i + 1)
            assert text[i] == ")"
            return i + 1
        j = i
        while j < len(text) and text[j].isdigit():
            j += 1
        assert j > i
        return j

    def expr(i: int) -> int:
        i = term(i)
        while i < len(text) and text[i] == "+":
            i = term(i + 1)
        return i

    try:
        return expr(0) == len(text)
    except (AssertionError, IndexError):
        return False


def raw_control_in_a_string(text: str) -> bool:
    """Whether a JSON text holds a raw control character (U+0000-U+001F) inside a string."""
    inside = escaped = False
    for ch in text:
        if inside and ord(ch) < 0x20:
            return True
        if ch == '"' and not escaped:
            inside = not inside
        escaped = inside and ch == "\\" and not escaped
    return False


BOUNDED = {"type": "object", "additionalProperties": False, "required": ["name", "code"],
           "properties": {"name": {"type": "string", "minLength": 8, "maxLength": 16},
                          "code": {"type": "string", "maxLength": 4}}}


def test_length_bounded_strings_hold_no_raw_control_character(core, tok, prompt):
    """xgrammar lets raw control characters into a string with minLength/maxLength (not JSON);
    a tab the model is biased towards goes only where JSON allows it, between tokens."""
    tab = 197
    assert tok.decode([tab]) == "\t"
    constraint = json_constraint(BOUNDED)
    for i, temperature in enumerate((0.0, 0.7, 1.0)):
        core.add_request(f"t{i}", prompt, SamplingParams(
            max_tokens=120, temperature=temperature, seed=i, logit_bias={tab: 8.0},
            structured=constraint))
    for result in run(core).values():
        text = text_of(tok, result)
        assert result.finish == "stop" and "\t" in text and not raw_control_in_a_string(text)
        jsonschema.validate(json.loads(text), BOUNDED)
        assert accepted_prefix(core, constraint, result.token_ids)


def test_greedy_is_the_argmax_of_the_masked_raw_logits(core, prompt):
    """Replaying each greedy choice with a matcher of the test's own: the chosen token is the
    best-ranked allowed token of the model's raw top-20, with that raw rank (so logprobs are
    the raw model's), or ranks below the top 20 when none of them is allowed."""
    constraints = [json_constraint(s) for s in SCHEMAS[:4]] + [StructuredOutput("regex", REGEX)]
    for i, c in enumerate(constraints):
        core.add_request(f"g{i}", prompt, SamplingParams(max_tokens=60, temperature=0.0,
                                                         logprobs=20, structured=c))
    results = run(core)
    vocab = core.facts.vocab_size
    for i, c in enumerate(constraints):
        result = results[f"g{i}"]
        grammar = core.grammars.grammar_for(c)
        grammar.wait(30)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        for token, rank, top in zip(result.token_ids, result.ranks, result.top_ids, strict=True):
            grammar.matcher.fill_next_token_bitmask(bitmask)
            allowed = [t for t in top if bitmask[0, t // 32] >> (t % 32) & 1]
            if allowed:
                assert token == allowed[0] and rank == top.index(token) + 1
            else:
                assert rank > len(top)
            assert grammar.accept(token)


def test_preemption_keeps_matchers_in_step(tiny_llama, core, tok, prompt):
    """A cache too small for the batch preempts (and recomputes) constrained requests; their
    greedy outputs equal those of a roomy engine."""
    # 14 blocks of 8: the fewest that hold one request (9 + 100 tokens)
    small = EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=14, block_size=8,
                                    max_model_len=512))
    long_text = {"type": "object", "required": ["text"], "additionalProperties": False,
                 "properties": {"text": {"type": "string", "minLength": 200, "maxLength": 220}}}
    constraints = [json_constraint(long_text), StructuredOutput("regex", "[a-z ]{200,220}"),
                   StructuredOutput("json_object")] * 2
    outputs = []
    for engine in (core, small):
        for i, c in enumerate(constraints):
            engine.add_request(f"p{i}", prompt + [i + 10], SamplingParams(
                max_tokens=100, temperature=0.0, structured=c))
        for c in constraints:  # compiled before the first step: all six admitted together
            engine.grammars.grammar_for(c).wait(30)
        outputs.append(run(engine))
    assert small.scheduler.num_preemptions > 0
    for i in range(len(constraints)):
        assert outputs[0][f"p{i}"].token_ids == outputs[1][f"p{i}"].token_ids
        assert outputs[0][f"p{i}"].finish == outputs[1][f"p{i}"].finish
        assert accepted_prefix(small, constraints[i], outputs[1][f"p{i}"].token_ids)
    assert small.blocks.num_free_blocks == small.blocks.num_blocks
    small.grammars.close()


def test_a_compiling_grammar_stalls_no_one(core, prompt):
    """While the compiler is busy, a free request runs; the constrained one joins after."""
    gate = threading.Event()
    core.grammars._pool.submit(gate.wait, 30)  # occupy the one compile thread
    fresh = json_constraint({"type": "object", "required": ["late"], "additionalProperties": False,
                             "properties": {"late": {"type": "boolean"}}})
    core.add_request("constrained", prompt, SamplingParams(max_tokens=20, temperature=0.0,
                                                           structured=fresh))
    core.add_request("free", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    results: dict[str, Collected] = {}
    try:
        for _ in range(4):
            run_one_step(core, results)
        assert len(results["free"].token_ids) == 3 and results["free"].finish == "length"
        assert "constrained" not in results
        assert [r.request_id for r in core.scheduler.waiting] == ["constrained"]
    finally:
        gate.set()
    run(core, results)
    assert results["constrained"].finish == "stop"


def run_one_step(core: EngineCore, results: dict[str, Collected]) -> None:
    from tests.engine.driver import absorb

    for out in core.step().values():
        absorb(out, results)


BAD = [
    StructuredOutput("regex", "("),
    StructuredOutput("grammar", "root ::= missing"),
    StructuredOutput("json", '{"type": "wat"}'),
    StructuredOutput("json", "{not json"),
    StructuredOutput("teleport", "x"),
]


def test_bad_constraints_are_refused_with_the_compilers_message(core, prompt):
    for i, c in enumerate(BAD):
        core.add_request(f"bad{i}", prompt, SamplingParams(max_tokens=5, structured=c))
        core.add_request(f"bad{i}-again", prompt, SamplingParams(max_tokens=5, structured=c))
    core.add_request("fine", prompt, SamplingParams(max_tokens=5))
    results = run(core)
    for i, c in enumerate(BAD):
        for rid in (f"bad{i}", f"bad{i}-again"):  # the second one from the cache
            assert results[rid].finish == "error" and results[rid].token_ids == []
            assert "does not compile" in (results[rid].message or ""), results[rid].message
    assert "Regex" in (results["bad0"].message or "") and "[" not in results["bad0"].message
    assert results["fine"].finish == "length"
    assert not core.scheduler.requests and not core.scheduler.compiling


def test_a_mixed_burst_leaves_nothing_behind(core, prompt):
    kinds = [json_constraint(SCHEMAS[0]), StructuredOutput("regex", REGEX), None,
             StructuredOutput("choice", json.dumps(CHOICES)), BAD[0], None]
    results: dict[str, Collected] = {}
    for i in range(36):
        c = kinds[i % len(kinds)]
        core.add_request(f"m{i}", prompt + [i], SamplingParams(
            max_tokens=8 + i % 30, temperature=(i % 3) * 0.5, seed=i, structured=c))
        if i % 7 == 3:
            run_one_step(core, results)
    core.abort(["m5", "m12"])  # aborted: the engine says nothing more about them
    run(core, results)
    for i in set(range(36)) - {5, 12}:
        assert results[f"m{i}"].finish in ("stop", "length", "error"), i
    assert not core.scheduler.requests and not core.scheduler.compiling
    assert core.blocks.num_free_blocks == core.blocks.num_blocks
    assert all(r.grammar is None for r in core.scheduler.running)
    assert FinishReason.ERROR in core.stats().rejected


def test_a_token_the_mask_lets_through_but_the_grammar_refuses_is_drawn_again(core, tok,
                                                                               prompt):
    """xgrammar's mask allows 'Ġð' (a space and the first byte of a 4-byte character) under
    this regex, but its matcher refuses it; biased to be the argmax, it must be redrawn."""
    bad = 109697
    assert tok.convert_ids_to_tokens(bad) == "Ġð"
    core.add_request("r", prompt, SamplingParams(
        max_tokens=20, temperature=0.0, logit_bias={bad: 100.0},
        structured=StructuredOutput("regex", "[a-z ]{1,5}")))
    result = run(core)["r"]
    assert bad not in result.token_ids and result.finish == "stop"
    assert re.fullmatch("[a-z ]{1,5}", text_of(tok, result))


THINK_END = 128014  # "</think>", one token of the embedded tokenizer (DeepSeek-R1-Distill's)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=5)])
def test_a_thinking_request_is_constrained_from_the_token_after_its_end(core, tok, prompt,
                                                                        sampling):
    """`reasoning_end`: until the marker the output is the unconstrained one, token for token;
    forced by logit bias, the marker comes first and then the grammar, as if the prompt had
    ended with it (greedy: the same tokens), and the JSON is valid and ends (its whitespace
    bounded), however strongly the bias pulls towards the marker."""
    schema = SCHEMAS[2]
    constraint = json_constraint(schema)
    bias = {THINK_END: 100.0}
    core.add_request("free", prompt, SamplingParams(max_tokens=24, **sampling))
    core.add_request("thinking", prompt, SamplingParams(
        max_tokens=24, structured=constraint, reasoning_end=[THINK_END], **sampling))
    core.add_request("forced", prompt, SamplingParams(
        max_tokens=80, logit_bias=bias, structured=constraint, reasoning_end=[THINK_END],
        **sampling))
    core.add_request("after", prompt + [THINK_END], SamplingParams(
        max_tokens=79, logit_bias=bias, structured=constraint, **sampling))
    results = run(core)
    assert THINK_END not in results["free"].token_ids
    assert results["thinking"].token_ids == results["free"].token_ids
    forced, after = results["forced"], results["after"]
    assert forced.token_ids[0] == THINK_END and forced.finish == after.finish == "stop"
    if sampling["temperature"] == 0.0:  # a seeded draw spent one number on the marker
        assert forced.token_ids[1:] == after.token_ids
    text = str(tok.decode(forced.token_ids[1:], skip_special_tokens=True))
    jsonschema.validate(json.loads(text), schema)
    assert accepted_prefix(core, constraint, forced.token_ids[1:])
    assert not core.scheduler.requests
