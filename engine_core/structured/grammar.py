"""Structured outputs' grammars: constraints compiled off the step loop, and one grammar
matcher per constrained request.

The grammar engine is xgrammar. It is imported on first use, on the compile thread, so an
engine that never sees a constraint never loads it (nor builds its tokenizer table).

- `GrammarCompiler.grammar_for` starts compiling a constraint on one worker thread and returns
  the request's `RequestGrammar` at once; compiled grammars are cached by constraint, so a
  repeated schema is ready immediately. The scheduler lets a request join the batch only once
  its grammar is ready, and refuses it (with the compiler's message) when it failed.
- Each `RequestGrammar` owns its matcher, advanced by the sampler with every token it draws
  for the request (each one is appended). Preemption keeps a request's output tokens (it is
  recomputed, not resampled), so the matcher, which has seen exactly those tokens, stays
  valid as it is.
- Speculative decoding: a constrained request's draft rows each sample under a fork of its
  matcher (`RequestGrammar.forks`, after the drafts before the row), and the request `adopt`s
  the fork of the last row it emitted (engine_core/sample/speculative.py).

JSON whitespace: with unbounded whitespace a model can loop on whitespace tokens until
max_tokens (vLLM #38696), so each gap between JSON tokens holds at most MAX_WHITESPACE
characters; `any_whitespace=False` keeps only the single spaces of the separators ", " and ": ".
Object properties a schema does not list are never generated (xgrammar's strict mode).

A JSON string with `minLength`/`maxLength` is one JSON character per repetition: xgrammar (0.2.9)
lowers it to a class that lets raw control characters in, which is not JSON, and no escape
(mlc-ai/xgrammar#800), so `json_schema_grammar` rewrites that rule of its grammar.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from shared.messages import StructuredOutput

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger(__name__)

MAX_WHITESPACE = 8  # characters per gap between JSON tokens (see the module docstring)
CACHE_SIZE = 256  # compiled constraints kept
KINDS = ("json", "json_object", "regex", "choice", "grammar")

_CompileKey = tuple[str, str, bool]


class GrammarCompiler:
    """Compiles constraints on one worker thread, with a cache keyed by the constraint."""

    def __init__(self, tokenizer: str, vocab_size: int, stop_token_ids: Sequence[int],
                 trust_remote_code: bool = False) -> None:
        """`vocab_size` is the model's (the logits' width), which may exceed the tokenizer's;
        `stop_token_ids` end a grammar (the model's EOS ids)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.trust_remote_code = trust_remote_code
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compiler")
        self._cache: OrderedDict[_CompileKey, Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._compiler: xgrammar.GrammarCompiler | None = None  # built on the worker thread

    def grammar_for(self, constraint: StructuredOutput) -> RequestGrammar:
        """A new request's grammar; compiling (or cached already)."""
        key = (constraint.kind, constraint.spec, constraint.any_whitespace)
        future = self._cache.get(key)
        if future is None:
            future = self._pool.submit(self._compile, constraint)
            self._cache[key] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return RequestGrammar(future)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, c: StructuredOutput) -> xgrammar.CompiledGrammar:
        compiler = self._compiler or self._build_compiler()
        try:
            return _compile_with(compiler, c)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ConstraintError(f"the {_NAMES.get(c.kind, c.kind)} does not compile: "
                                  f"{_compiler_message(exc)}") from None

    def _build_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.tokenizer,
                                            trust_remote_code=self.trust_remote_code)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tok, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler


class ConstraintError(Exception):
    """A constraint the grammar engine rejects; its message is for the user."""


_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
          "choice": "choice list", "grammar": "grammar"}


def _compile_with(compiler: xgrammar.GrammarCompiler,
                  c: StructuredOutput) -> xgrammar.CompiledGrammar:
    if c.kind == "json":
        return compiler.compile_grammar(json_schema_grammar(c.spec, True, c.any_whitespace))
    if c.kind == "json_object":  # any object: extra properties are the point here
        return compiler.compile_grammar(
            json_schema_grammar('{"type": "object"}', False, c.any_whitespace))
    if c.kind == "regex":
        return compiler.compile_regex(c.spec)
    if c.kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(c.spec)))
    if c.kind == "grammar":
        return compiler.compile_grammar(c.spec)
    raise ValueError(f"unknown constraint kind {c.kind!r} (expected one of {', '.join(KINDS)})")


# The rule of one character of a length-bounded JSON string, as xgrammar writes it, and what it
# becomes: a character JSON allows unescaped, or one escape (\uXXXX outside the surrogates, so
# that each repetition is one character of the decoded string, as maxLength counts them).
_BOUNDED_CHARACTER = re.compile(r"^(\w+) ::= " + re.escape(r'(([^\"\\\r\n]))') + "$",
                                re.MULTILINE)
_JSON_CHARACTER = (r'([^\0-\x1f\"\\] | "\\" [\"\\/bfnrt]'
                   r' | "\\u" ([0-9A-Ca-cE-Fe-f] [0-9A-Fa-f]{3} | [Dd] [0-7] [0-9A-Fa-f]{2}))')


def json_schema_grammar(schema: str, strict: bool, any_whitespace: bool) -> xgrammar.Grammar:
    """xgrammar's grammar for a JSON schema, whitespace bounded (`any_whitespace`: up to
    MAX_WHITESPACE characters per gap, else the separators' single spaces), each character of a
    length-bounded string one JSON character (see the module docstring)."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(
        schema, strict_mode=strict, any_whitespace=any_whitespace,
        max_whitespace_cnt=MAX_WHITESPACE if any_whitespace else None)
    ebnf = _BOUNDED_CHARACTER.sub(lambda rule: f"{rule[1]} ::= {_JSON_CHARACTER}", str(grammar))
    return xgrammar.Grammar.from_ebnf(ebnf)


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices)


_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[12:00:00] /path/file.cc:94: "


def _compiler_message(exc: Exception) -> str:
    """The compiler's own words, without its timestamp and source location."""
    return _LOCATION.sub("", str(exc).strip()).strip() or type(exc).__name__


class RequestGrammar:
    """One request's grammar: compiling, then a matcher that has seen every output token."""

    def __init__(self, compiled: Future[xgrammar.CompiledGrammar]) -> None:
        self._compiled = compiled
        self._matcher: xgrammar.GrammarMatcher | None = None
        self.lost = False  # the sampler found no token the matcher accepts: give up

    @property
    def ready(self) -> bool:
        """Compiled, or failed (then `error` says why)."""
        return self._compiled.done()

    @property
    def error(self) -> str | None:
        if not self._compiled.done():
            return None
        exc = self._compiled.exception()
        return None if exc is None else str(exc)

    def wait(self, timeout_s: float) -> None:
        """Block until compiled (or `timeout_s` passed); for an engine with nothing else to do."""
        try:
            self._compiled.exception(timeout=timeout_s)
        except TimeoutError:
            pass

    @property
    def matcher(self) -> xgrammar.GrammarMatcher:
        if self._matcher is None:
            import xgrammar

            self._matcher = xgrammar.GrammarMatcher(self._compiled.result())
        return self._matcher

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar ended (a stop token was accepted where it may end)."""
        return bool(self.matcher.is_terminated())

    def forks(self, drafts: Sequence[int]) -> tuple[list[RequestGrammar], int]:
        """Speculative decoding: the grammar as it would be after each prefix of `drafts`
        (d_0..d_{j-1} for j = 0, 1, ...), each a copy with its own matcher for one draft row to
        advance, as far as the drafts go on inside the grammar; and how many drafts may be
        accepted (a draft the grammar refuses, or one that ends it, is not: the rows after it
        are never emitted). The grammar itself is left as it is."""
        forks = [self._fork(self.matcher.fork())]
        walker = self.matcher.fork()
        for token in drafts:
            if not walker.accept_token(token) or walker.is_terminated():
                break
            forks.append(self._fork(walker.fork()))
        return forks, len(forks) - 1

    def walker(self) -> RequestGrammar:
        """A copy to advance past tokens that are not the request's (a draft model's drafts)."""
        return self._fork(self.matcher.fork())

    def _fork(self, matcher: xgrammar.GrammarMatcher) -> RequestGrammar:
        fork = RequestGrammar(self._compiled)
        fork._matcher = matcher
        return fork

    def adopt(self, fork: RequestGrammar) -> None:
        """Take a fork's state: the one whose row's token was emitted last (it has seen
        exactly the tokens the request now has)."""
        self._matcher, self.lost = fork._matcher, fork.lost
