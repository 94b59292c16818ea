"""Structured outputs on the device (issue 14): the token masks applied by the device sampler.

In bfloat16 on the checked device (the CPU in the dry run), every request under a grammar — the
engine tests' JSON schemas, a regex, a choice — at temperature 0 and 0.8: an output that ends
"stop" parses and validates (`jsonschema`, or Python's `re`, or the choice list), one cut by
max_tokens is a prefix a fresh matcher accepts token by token; a greedy token is the masked
argmax of the raw logits (no allowed token of the raw top-20 ranks above it). Then the median
decode step of a whole batch of free requests against one of constrained requests (the grammars
compiled in advance): what the grammar work costs a step. The constrained rows there run
grammars no output of max_tokens tokens can complete (`long_constraints`), so every row stays
to the end and every step after the prefill decodes the whole batch (with the engine tests'
grammars, most rows finished within a few tokens and no step was ever full).
"""

from __future__ import annotations

import json
import re
import statistics
import time
from typing import Any

import jsonschema
import xgrammar
from transformers import AutoTokenizer

from engine_core.engine import EngineCore
from shared.messages import SamplingParams, StructuredOutput
from tests.device.context import Context, EngineRunError, check_run, sampled
from tests.engine.driver import Collected, run
from tests.engine.test_structured import CHOICES, REGEX, SCHEMAS

TOP = 20
DTYPE = "bfloat16"


def constraints() -> dict[str, tuple[StructuredOutput, Any]]:
    """Each constraint by name, with the check of a complete output's text."""
    out: dict[str, tuple[StructuredOutput, Any]] = {
        f"json{i}": (StructuredOutput("json", json.dumps(s)),
                     lambda text, s=s: jsonschema.validate(json.loads(text), s) is None)
        for i, s in enumerate(SCHEMAS)}
    out["regex"] = (StructuredOutput("regex", REGEX), lambda t: re.fullmatch(REGEX, t))
    out["choice"] = (StructuredOutput("choice", json.dumps(CHOICES)), lambda t: t in CHOICES)
    return out


def structured(ctx: Context) -> dict[str, Any]:
    core = ctx.engine(DTYPE)
    tokenizer = AutoTokenizer.from_pretrained(ctx.model)
    prompt = list(tokenizer("Answer in the requested format:").input_ids)
    checks = constraints()
    for name, (constraint, _) in checks.items():
        for temperature in (0.0, 0.8):
            core.add_request(f"{name}@{temperature}", prompt, SamplingParams(
                max_tokens=ctx.sizes.structured_new_tokens, temperature=temperature, seed=7,
                logprobs=TOP, structured=constraint))
    errors = core.stats().step_errors
    results = run(core)
    check_run(core, results, {rid: ctx.sizes.structured_new_tokens for rid in results}, errors)
    failures: list[dict[str, Any]] = []
    finished = {"stop": 0, "length": 0}
    for rid, result in results.items():
        name, temperature = rid.split("@")
        constraint, check = checks[name]
        problem = judge(core, tokenizer, constraint, check, result, float(temperature) == 0.0)
        finished[result.finish or "none"] = finished.get(result.finish or "none", 0) + 1
        if problem:
            failures.append({"request": rid, "problem": problem,
                             "text": tokenizer.decode(result.token_ids)[:200]})
    stats = core.stats()
    leaked = stats.num_blocks - stats.free_blocks
    speed = constrained_speed(ctx, core, prompt)
    return {"dtype": DTYPE, "requests": len(results), "finished": finished,
            "failures": failures[:5], "blocks_in_use_after": leaked, **speed,
            "passed": not failures and not leaked and finished["stop"] > 0}


def judge(core: EngineCore, tokenizer: Any, constraint: StructuredOutput, check: Any,
          result: Collected, greedy: bool) -> str | None:
    """What is wrong with one constrained output, or None."""
    if result.finish not in ("stop", "length"):
        return f"finished {result.finish}: {result.message}"
    grammar = core.grammars.grammar_for(constraint)
    grammar.wait(60)
    vocab = core.facts.vocab_size
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    tokens = result.token_ids
    for k, token in enumerate(tokens):
        grammar.matcher.fill_next_token_bitmask(bitmask)
        allowed = [t for t in result.top_ids[k] if bitmask[0, t // 32] >> (t % 32) & 1]
        if not bitmask[0, token // 32] >> (token % 32) & 1:
            return f"token {k} ({token}) is outside its mask"
        # greedy: nothing allowed ranks above the token (ties with the best allowed are fine)
        if greedy and allowed and result.ranks[k] > result.top_ids[k].index(allowed[0]) + 1:
            return f"token {k} ({token}, rank {result.ranks[k]}) is not the masked argmax"
        if not grammar.accept(token):
            return f"token {k} ({token}) is refused by a fresh matcher"
    if result.finish == "stop":
        if tokens[-1] not in core.facts.eos_token_ids:
            return "stopped without an end-of-sequence token"
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        try:
            if not check(text):
                return "the complete output fails its check"
        except (ValueError, jsonschema.ValidationError) as exc:
            return f"the complete output fails its check: {exc}"
    return None


def long_constraints(tokens: int) -> list[StructuredOutput]:
    """JSON arrays of more items than `tokens`, each item at least one token (a number, a word:
    Llama 3's pre-tokenizer never puts digits or letters in one token with punctuation), so no
    output of `tokens` tokens can complete them: a constrained row ends by max_tokens alone."""
    items = tokens + 1
    schemas: list[dict[str, Any]] = [
        {"type": "integer"}, {"type": "boolean"}, {"enum": ["red", "green", "blue"]},
        {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}]
    return [StructuredOutput("json", json.dumps({"type": "array", "items": item,
                                                 "minItems": items}))
            for item in schemas]


def constrained_speed(ctx: Context, core: EngineCore, prompt: list[int]) -> dict[str, Any]:
    """The median decode step at the full batch, every row free against every row constrained:
    the grammar work's cost per step. Each constraint is compiled before it is timed."""
    kinds = long_constraints(ctx.sizes.structured_new_tokens)
    for constraint in kinds:
        core.grammars.grammar_for(constraint).wait(120)
    free, free_steps = decode_step_ms(ctx, core, prompt, lambda i: None)
    constrained, steps = decode_step_ms(ctx, core, prompt, lambda i: kinds[i % len(kinds)])
    return {"batch": ctx.sizes.batch, "free_step_ms": round(free, 3),
            "constrained_step_ms": round(constrained, 3),
            "constrained_over_free": round(free / constrained, 3),
            "full_steps": min(free_steps, steps)}


def decode_step_ms(ctx: Context, core: EngineCore, prompt: list[int],
                   structured: Any) -> tuple[float, int]:
    """Median time of the steps that decode the whole batch (every row already had its first
    token and gets one more), and how many there were: the rows must stay for the whole
    measurement, all but the prefill's steps and the last few (rows whose prefill ended a step
early finish a step early)."""
    batch, tokens = ctx.sizes.batch, ctx.sizes.structured_new_tokens
    errors = core.stats().step_errors
    for i in range(batch):
        core.add_request(f"speed{i}", prompt + [i + 10], SamplingParams(
            max_tokens=tokens, temperature=0.0, ignore_eos=True, structured=structured(i)))
    times: list[float] = []
    started: set[str] = set()
    while core.has_work:
        before = len(started)
        ctx.sync()
        start = time.perf_counter()
        outputs = core.step()
        ctx.sync()
        elapsed = time.perf_counter() - start
        if sampled(outputs, started) == batch and before == batch:
            times.append(elapsed)
    if core.stats().step_errors != errors:
        raise EngineRunError(f"{core.stats().step_errors - errors} engine step(s) failed")
    if len(times) < tokens // 2:
        raise EngineRunError(f"{len(times)} of {tokens - 1} decode steps decoded the whole "
                             "batch: rows left before the end")
    return statistics.median(times) * 1000, len(times)
