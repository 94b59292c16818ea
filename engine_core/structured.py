"""Structured outputs in the engine: constraints compiled off the step loop, one grammar matcher
per constrained request, and the step's token bitmask.

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
- `TokenMasker` fills one bitmask row per constrained row of a step, all rows in one call,
  and advances their matchers in one call; `allows`, `apply_bitmask` and `read_masks` read a
  bitmask (the masked draws, engine_core/constrained_sampling.py).

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
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

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


class TokenMasker:
    """The grammar work of one step, each part one call for all of the step's constrained rows:
    filling their token bitmasks, and advancing their matchers past the drawn tokens."""

    def __init__(self) -> None:
        import xgrammar

        self._xgr = xgrammar
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=1)

    def fill(self, rows: int, vocab: int, constrained: Sequence[int],
             grammars: Sequence[RequestGrammar]) -> torch.Tensor:
        """A step's bitmask [rows, ceil(vocab / 32)] int32 on the CPU: row `constrained[i]`
        allows `grammars[i]`'s next tokens, every other row allows every token. `vocab` is the
        model's (the logits' width), as the grammars were compiled for."""
        bitmask = self._xgr.allocate_token_bitmask(rows, vocab)
        self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask,
                                                  indices=list(constrained))
        return bitmask

    def accept(self, grammars: Sequence[RequestGrammar], tokens: Sequence[int]) -> list[bool]:
        """Advance each grammar past its token; False where the grammar refuses it (the matcher
        is then left as it was)."""
        return list(self._batch.batch_accept_token([g.matcher for g in grammars], list(tokens)))


def allows(bitmask: torch.Tensor, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    """Whether row `rows[i]` of `bitmask` allows `tokens[i]` (bool [n]): one bit each."""
    at = np.asarray(tokens, dtype=np.int64)
    words = bitmask.numpy()[np.asarray(rows, dtype=np.int64), at // 32]
    return ((words >> (at % 32)) & 1).astype(bool)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set every logit the bitmask (of the same rows, on the CPU) disallows to -inf, in place:
    xgrammar's kernel on CUDA, its CPU loop elsewhere."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device),
                                         vocab_size=logits.shape[1])


class AllowedIds(NamedTuple):
    """Each bitmask row's allowed tokens, ascending, padded to the longest row."""

    ids: np.ndarray  # [rows, n] int64, 0 where not valid
    valid: np.ndarray  # [rows, n] bool


class MaskRows(NamedTuple):
    """A bitmask's rows, read for the masked draws."""

    broad: list[bool]  # whether at least a given share of the row's words allow some token
    narrow: AllowedIds  # the allowed tokens of the rows that are not broad (none for the rest)


def read_masks(bitmask: torch.Tensor, vocab: int, share: float) -> MaskRows:
    """Which rows are broad (the share of their words that allow some token, a cheap stand-in
    for the share of the vocabulary, is at least `share`), and the allowed tokens (below
    `vocab`) of the others. One pass finds the words with a bit set; only the narrow rows'
    are unpacked, so a grammar that allows a few tokens costs a few, not the vocabulary."""
    words = bitmask.numpy()
    row_of, word = np.nonzero(words)  # row-major: rows, then words, ascend
    broad = np.bincount(row_of, minlength=len(words)) >= share * words.shape[1]
    if broad.any():
        narrow = ~broad[row_of]
        row_of, word = row_of[narrow], word[narrow]
    return MaskRows(broad.tolist(), _unpack(words, row_of, word, vocab))


def _unpack(words: np.ndarray, row_of: np.ndarray, word: np.ndarray, vocab: int) -> AllowedIds:
    """The tokens below `vocab` allowed by words `word` of rows `row_of` (row-major) of
    `words`, a row of AllowedIds per row of `words`."""
    # bit j of a word is column j: its little-endian bytes, each unpacked lowest bit first
    octets = words[row_of, word].astype("<i4").view(np.uint8).reshape(-1, 4)
    entry, bit = np.nonzero(np.unpackbits(octets, axis=1, bitorder="little"))
    row, token = row_of[entry], word[entry] * 32 + bit
    below = token < vocab
    row, token = row[below], token[below]
    counts = np.bincount(row, minlength=len(words))
    position = np.arange(len(row)) - (counts.cumsum() - counts)[row]
    width = max(1, int(counts.max(initial=0)))
    ids = np.zeros((len(words), width), dtype=np.int64)
    valid = np.zeros((len(words), width), dtype=bool)
    ids[row, position] = token
    valid[row, position] = True
    return AllowedIds(ids, valid)
