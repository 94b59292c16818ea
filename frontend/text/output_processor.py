"""Per-choice output processing: token ids and logprobs in, client deltas out.

One ChoiceProcessor per choice (n>1 means n processors). Let `full` be the concatenation of every
delta's `text` (echoed prompt included). Invariants, whatever the grouping of steps:

- generated text == tokenizer.decode(generated ids, skip_special_tokens=...), cut at a stop
  string; the terminating token (EOS or a stop_token_ids token, the final token of a "stop"
  finish) adds no text unless include_stop_str_in_output;
- text_offset[k] is where token k's text starts in `full`, clamped to len(full) when a stop
  string cut the text; offsets never decrease, the first is 0 with echo; a token that is only
  part of a character owns no characters, the token completing it owns all of it;
- a token's entry (its generated token, its logprob entry) is released in the delta that
  releases the first of its text, or text after it, or at finish: no delta carries entries
  without text except the last one;
- merging every delta in order (`merge_deltas`) gives the non-streaming answer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple

import msgspec

from frontend.text.byte_pieces import BytePieces
from frontend.text.detokenizer import IncrementalDetokenizer
from frontend.text.logprob_text import TokenTextCache, first_wins, token_id_repr
from frontend.text.stop_strings import StopStringChecker
from shared.step_outputs import PromptRows, TokenLogprob

__all__ = ["ChoiceDelta", "ChoiceProcessor", "GeneratedToken", "OutputOptions", "merge_deltas"]


@dataclass(frozen=True)
class OutputOptions:
    """How a request's choices turn into text: decided once per request, by the planner."""

    echo: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token + top-k
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    # Deltas carry the generated tokens (`ChoiceDelta.generated`): chat's logprobs are built
    # from them. Without logprobs nobody reads them, and not keeping them is cheaper.
    generated_tokens: bool = True


class GeneratedToken(NamedTuple):
    """A generated token released with a delta, as the engine sent it: for APIs that shape
    logprobs their own way (chat) from token ids rather than from the completions entries."""

    token_id: int
    logprob: TokenLogprob | None  # None when logprobs were not asked
    terminator: bool  # the EOS / stop token that ended the choice and added no text


class ChoiceDelta(msgspec.Struct, gc=False):
    """What one choice gained since the previous call. (A msgspec Struct for its C-level
    constructor, one delta per choice per wake-up on the hottest path; its sequences are the
    shared empty tuple unless filled, and it is left out of the garbage collector's passes,
    which is safe: what it holds never refers back to it.)"""

    text: str = ""
    generated: Sequence[GeneratedToken] = ()  # released with this delta
    tokens: Sequence[str] = ()  # filled only when logprobs were asked
    token_logprobs: Sequence[float | None] = ()
    top_logprobs: Sequence[dict[str, float] | None] = ()
    text_offset: Sequence[int] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    stop_reason: str | int | None = None  # the matched stop string, or the stop token id

    @property
    def token_ids(self) -> list[int]:
        """The generated ids released with this delta, in order."""
        return [g.token_id for g in self.generated]

    @property
    def is_empty(self) -> bool:
        """Nothing worth sending: no text, no entries, no finish."""
        no_entries = not self.generated and not self.tokens
        return not self.text and no_entries and self.finish_reason is None


# A token's entry, waiting for its text: (generated, offset, token, logprob, top). `generated` is
# None for a prompt token (echo); `offset` is where the token's text starts in `full` (before any
# clamping); `token`, `logprob` and `top` are None when logprobs were not asked (`logprob` and
# `top` also for the prompt's first token). A plain tuple, so that a prompt's entries are made
# in one go (zip) rather than one constructor call each.
_Entry = tuple[GeneratedToken | None, int, str | None, float | None, dict[str, float] | None]


class ChoiceProcessor:
    """Turns one choice's engine steps into deltas of final text and logprob entries."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        options: OutputOptions,
        token_text: TokenTextCache | None = None,
        pieces: BytePieces | None = None,
    ) -> None:
        """`token_text`: the tokenizer's shared token strings (made here if None); `pieces`: its
        shared BytePieces, the detokenizer's fast path (None: the general path)."""
        self._tokenizer = tokenizer
        self._prompt_ids = list(prompt_token_ids)
        self._options = options
        self._token_text = token_text if token_text is not None else TokenTextCache(tokenizer)
        self._pieces = pieces
        self._detok = self._detokenizer(context_ids=self._prompt_ids)
        self._stop = StopStringChecker(options.stop, options.include_stop_str_in_output)
        self._produced = 0  # length of `full` had nothing been held back or cut
        self._released = 0  # length of `full` so far (text handed out)
        self._text_out: list[str] = []  # released text not yet returned in a delta
        self._entries: deque[_Entry] = deque()  # entries waiting for their text
        self._num_generated = 0
        self.finish_reason: str | None = None  # set once the choice finished
        self._stop_reason: str | int | None = None
        self._finish_sent = False  # a delta carried the finish reason
        # Per-token entries are queued only when someone reads them (logprobs, or chat's
        # generated tokens); stop strings are checked only when there are some.
        self._entries_wanted = options.logprobs is not None or options.generated_tokens
        self._has_stops = bool(options.stop)
        self._text_only = not (self._entries_wanted or self._has_stops)  # feed's short path

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_by_string(self) -> bool:
        """True once a stop string matched: the caller must abort the request in the engine."""
        return self._stop.matched is not None

    @property
    def num_generated_tokens(self) -> int:
        """Every token the engine produced for this choice up to its finish (EOS and tokens of
        a stop string included), for usage.completion_tokens."""
        return self._num_generated

    def prompt(self, prompt_logprobs: Sequence[TokenLogprob] | None) -> ChoiceDelta:
        """Call once, before any step. With echo: the prompt text and, when logprobs were
        asked, one entry per prompt token (the first with logprob and top None);
        `prompt_logprobs` are those of prompt tokens 1..P-1."""
        self.feed_prompt(prompt_logprobs)
        return self.delta()

    def feed_prompt(self, prompt_logprobs: Sequence[TokenLogprob] | None) -> None:
        """`prompt`, its delta left for the next `delta()`."""
        if self._options.echo:
            if self._options.logprobs is None:
                self._emit(
                    self._tokenizer.decode(
                        self._prompt_ids,
                        skip_special_tokens=self._options.skip_special_tokens,
                        spaces_between_special_tokens=self._options.spaces_between_special_tokens,
                    )
                )
            else:
                self._echo_tokens(prompt_logprobs)
            self._produced = self._released

    def _echo_tokens(self, prompt_logprobs: Sequence[TokenLogprob] | None) -> None:
        """The prompt decoded token by token, so that each token's offset is known; then every
        prompt token's entry at once (from the columns, when they come as PromptRows)."""
        ids, detok, emit = self._prompt_ids, self._detokenizer(), self._emit
        offsets = []
        for token_id in ids:
            released, text = self._released, detok.add(token_id)
            offsets.append(released + detok.last_token_start)
            if text:
                emit(text)
        emit(detok.flush())
        if prompt_logprobs is not None and (not isinstance(prompt_logprobs, PromptRows)
                                            or len(prompt_logprobs) != len(ids) - 1):
            for i, (token_id, offset) in enumerate(zip(ids, offsets)):
                self._queue(token_id, None if i == 0 else prompt_logprobs[i - 1], offset, None)
            return
        tokens = self._token_strings(ids)
        if prompt_logprobs is None:
            self._entries.extend(zip(repeat(None), offsets, tokens, repeat(None), repeat(None)))
            return
        values = prompt_logprobs.logprobs
        tops = self._top_dicts(tokens[1:], values, prompt_logprobs.top_ids,
                               prompt_logprobs.top_logprobs, prompt_logprobs.k)
        self._entries.append((None, offsets[0], tokens[0], None, None))
        self._entries.extend(zip(repeat(None), offsets[1:], tokens[1:], values, tops))

    def _token_strings(self, ids: Sequence[int]) -> list[str]:
        if self._options.return_tokens_as_token_ids:
            return [token_id_repr(int(i)) for i in ids]
        return self._token_text.strings(ids)

    def _top_dicts(self, tokens: list[str], values: list[float], top_ids: list[int],
                   top_values: list[float], width: int) -> list[dict[str, float]]:
        """TokenTextCache.top_dict of each token, its alternatives `width` a row in the flat
        columns (the rows made by zip and map, not one Python step per row: a prompt has many)."""
        k = self._options.logprobs
        assert k is not None
        keep = min(k, width)
        if keep == 0:
            tops: list[dict[str, float]] = [{} for _ in tokens]
        else:
            keys = self._token_strings(top_ids)
            if keep < width:
                keys = [key for row in range(0, len(keys), width) for key in keys[row:row + keep]]
                top_values = [v for row in range(0, len(top_values), width)
                              for v in top_values[row:row + keep]]
            key_rows = list(zip(*[iter(keys)] * keep))
            value_rows = list(zip(*[iter(top_values)] * keep))
            tops = list(map(dict, map(zip, key_rows, value_rows)))
            if min(map(len, tops), default=keep) < keep:  # a string twice: the first one's value
                tops = [first_wins(key_rows[row], value_rows[row]) if len(top) < keep else top
                        for row, top in enumerate(tops)]
        deque(map(dict.setdefault, tops, tokens, values), maxlen=0)  # the token itself, if not in
        return tops

    def _detokenizer(self, context_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self._tokenizer,
            skip_special_tokens=self._options.skip_special_tokens,
            spaces_between_special_tokens=self._options.spaces_between_special_tokens,
            context_ids=context_ids,
            pieces=self._pieces,
        )

    def step(
        self,
        token_id: int | None,
        logprob: TokenLogprob | None,
        finish_reason: str | None,
        stop_token_id: int | None = None,
    ) -> ChoiceDelta:
        """One engine step; `token_id` None means no token this step (possible with a finish).

        A token arriving with finish_reason "stop" is the terminating token. Returns only text
        that is final; after the choice finished, every call returns an empty delta.
        """
        if self.finished:
            return ChoiceDelta()
        self.feed(token_id, logprob, finish_reason, stop_token_id)
        return self.delta()

    def feed(
        self,
        token_id: int | None,
        logprob: TokenLogprob | None,
        finish_reason: str | None,
        stop_token_id: int | None = None,
    ) -> None:
        """`step`, its delta left for the next `delta()`: feeding several steps and taking one
        delta gives exactly the concatenation of their deltas (the merged chunk of a stream
        that fell behind). Ignored once the choice finished."""
        if self.finish_reason is not None:
            return
        if token_id is not None:
            self._num_generated += 1
            if self._text_only and finish_reason is None:  # the common step, kept short
                text = self._detok.add(token_id)
                if text:
                    self._produced += len(text)
                    self._text_out.append(text)
                    self._released += len(text)
                return
            if finish_reason == "stop" and not self._options.include_stop_str_in_output:
                self._generated_text(self._detok.flush())  # the terminator comes after it all
                if self._entries_wanted:
                    generated = (GeneratedToken(token_id, logprob, terminator=True)
                                 if self._options.generated_tokens else None)
                    self._queue(token_id, logprob, self._produced, generated)
            elif not self._entries_wanted:
                text = self._detok.add(token_id)
                if text:
                    self._generated_text(text)
            else:
                produced, text = self._produced, self._detok.add(token_id)
                generated = (GeneratedToken(token_id, logprob, terminator=False)
                             if self._options.generated_tokens else None)
                self._queue(token_id, logprob, produced + self._detok.last_token_start, generated)
                self._generated_text(text)
        if finish_reason is not None:
            self._finish(finish_reason, stop_token_id)
        elif self._stop.matched is not None:
            self.finish_reason, self._stop_reason = "stop", self._stop.matched

    def _finish(self, finish_reason: str, stop_token_id: int | None) -> None:
        if self._stop.matched is None:
            self._generated_text(self._detok.flush())
            self._emit(self._stop.flush())
            if self._stop.matched is None:
                self.finish_reason, self._stop_reason = finish_reason, stop_token_id
        if self._stop.matched is not None:
            self.finish_reason, self._stop_reason = "stop", self._stop.matched

    def _generated_text(self, text: str) -> None:
        """Newly final generated text: through the stop strings, then out."""
        if not self._has_stops:
            if text:
                self._produced += len(text)
                self._text_out.append(text)
                self._released += len(text)
        elif text and self._stop.matched is None:
            self._produced += len(text)
            self._emit(self._stop.feed(text).text)

    def _emit(self, text: str) -> None:
        """Hand `text` out: it ends `full` from now on."""
        self._text_out.append(text)
        self._released += len(text)

    def _queue(
        self,
        token_id: int,
        logprob: TokenLogprob | None,
        offset: int,
        generated: GeneratedToken | None,
    ) -> None:
        """Queue the token's entry; `offset` is where its text starts in `full`."""
        k = self._options.logprobs
        if k is None:
            self._entries.append((generated, offset, None, None, None))
            return
        as_ids = self._options.return_tokens_as_token_ids
        token = token_id_repr(token_id) if as_ids else self._token_text.get(token_id)
        if logprob is None:
            self._entries.append((generated, offset, token, None, None))
            return
        value, ids, values = float(logprob.logprob), logprob.top_ids, logprob.top_logprobs
        if len(ids) > k or len(values) > k:
            ids, values = ids[:k], values[:k]
        if values and values[0].__class__ is not float:  # (the wire's columns are floats)
            values = [float(v) for v in values]
        if as_ids:
            top = first_wins(self._token_strings(ids), values)
            top.setdefault(token, value)
        else:
            top = self._token_text.top_dict(token, value, ids, values)
        self._entries.append((generated, offset, token, value, top))

    def delta(self) -> ChoiceDelta:
        """What was released since the last delta: its text and the entries it releases (all of
        them at finish), and the finish reason the first time after the choice finished."""
        out = self._text_out
        delta = ChoiceDelta(out[0] if len(out) == 1 else "".join(out))
        out.clear()
        if self._entries:
            self._release_entries(delta)
        if self.finish_reason is not None and not self._finish_sent:
            self._finish_sent = True
            delta.finish_reason, delta.stop_reason = self.finish_reason, self._stop_reason
        return delta

    def _release_entries(self, delta: ChoiceDelta) -> None:
        entries, released = self._entries, self._released
        if len(entries) == 1 and (entries[0][1] < released or self.finished):  # (streaming)
            generated, offset, token, logprob, top = entries.pop()
            if generated is not None:
                delta.generated = [generated]
            if token is not None:
                delta.tokens, delta.token_logprobs, delta.top_logprobs = [token], [logprob], [top]
                delta.text_offset = [offset if offset < released else released]
        elif self.finished or entries[-1][1] < released:
            self._release_all(delta)
        else:
            self._release_due(delta)

    def _release_all(self, delta: ChoiceDelta) -> None:
        """Every queued entry, in one go (the columns by zip: offsets never decrease)."""
        released = self._released
        generated, offsets, tokens, logprobs, tops = zip(*self._entries)
        self._entries = deque()
        if self._options.generated_tokens:
            delta.generated = [g for g in generated if g is not None]
        if self._options.logprobs is not None:  # (then every entry has a token)
            delta.tokens, delta.token_logprobs, delta.top_logprobs = tokens, logprobs, tops
            delta.text_offset = (offsets if offsets[-1] < released
                                 else [o if o < released else released for o in offsets])

    def _release_due(self, delta: ChoiceDelta) -> None:
        """The entries whose text was released (all of them once finished)."""
        entries, released, finished = self._entries, self._released, self.finished
        generated: list[GeneratedToken] = []
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        while entries and (finished or entries[0][1] < released):
            generated_token, offset, token, logprob, top = entries.popleft()
            if generated_token is not None:
                generated.append(generated_token)
            if token is not None:
                tokens.append(token)
                values.append(logprob)
                tops.append(top)
                offsets.append(offset if offset < released else released)
        if generated:
            delta.generated = generated
        if tokens:
            delta.tokens, delta.token_logprobs = tokens, values
            delta.top_logprobs, delta.text_offset = tops, offsets


def merge_deltas(deltas: Iterable[ChoiceDelta]) -> ChoiceDelta:
    """Concatenate a choice's deltas in order: the non-streaming answer."""
    parts: list[str] = []
    generated: list[GeneratedToken] = []
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    for d in deltas:
        parts.append(d.text)
        generated += d.generated
        tokens += d.tokens
        values += d.token_logprobs
        tops += d.top_logprobs
        offsets += d.text_offset
        if d.finish_reason is not None:
            finish_reason, stop_reason = d.finish_reason, d.stop_reason
    return ChoiceDelta("".join(parts), generated, tokens, values, tops, offsets, finish_reason,
                       stop_reason)
