"""Incremental detokenizer: token ids in, text that is final out.

Invariant: the concatenation of every `add()` result and the final `flush()` equals
`tokenizer.decode(ids, skip_special_tokens=...)` of the ids added — for byte-level BPE
tokenizers exactly; decoders that drop a leading space at the start of a sequence (SentencePiece)
keep it here when context ids are given, as a continuation should.

A piece of a multi-byte UTF-8 character (decoded text ending in U+FFFD) is held back until the
character completes; `flush()` releases whatever is left, so the final text still equals
`tokenizer.decode`. Context ids (the prompt's tail) only shape how the first generated tokens
decode: their own text is never emitted, and a context that ends inside a character is cut back
to the last complete character so that its bytes cannot leak into the generated text.

Fastest path, for byte-level BPE tokenizers (`BytePieces`): each token's bytes into an
incremental UTF-8 decoder, which holds back an unfinished character's bytes; the text decoded
before them is held with them, so every path returns text at the same tokens (a stop string
then ends a choice at the same token whichever path found it). Next:
`tokenizers.decoders.DecodeStream`, for Rust-backed tokenizers whose `decode` adds no clean-up
of its own (then `tokenizer.decode` is the backend's decode, which DecodeStream follows).
Otherwise, or if DecodeStream ever fails, a prefix/read-offset window over `tokenizer.decode`
(the classic incremental scheme) does the same job.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from frontend.text.byte_pieces import BytePieces

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 6  # enough prompt tail for any decoder's look-back
_MAX_CHAR_TOKENS = 4  # a UTF-8 character has at most 4 bytes, so at most 4 byte tokens


class IncrementalDetokenizer:
    """Decode one sequence token by token; emits only text that is final."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
        use_decode_stream: bool = True,
        pieces: BytePieces | None = None,
    ) -> None:
        """`pieces`: the tokenizer's BytePieces, for the byte path (context is not needed
        there: a byte-level decode of the generated ids alone is what is asked)."""
        self._decode = _decode_function(
            tokenizer, skip_special_tokens, spaces_between_special_tokens
        )
        self._pieces = pieces
        self._skipped = pieces.special_ids if pieces is not None and skip_special_tokens else ()
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        if pieces is not None:
            context_ids, use_decode_stream = (), False
        context = complete_context(self._decode, context_ids)
        self._ids: list[int] = list(context)
        # The window: ids[prefix:read] decode to text already returned (or context), ids[read:]
        # are held back; the window moves on each time text is returned.
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._held_text = ""  # what the held-back tokens decode to, as of the last add()
        self._ready = ""  # byte path: complete text held with an unfinished character after it
        self.last_token_start = 0
        backend = _stream_backend(tokenizer) if use_decode_stream else None
        self._stream: tuple[DecodeStream, Tokenizer] | None = None
        if backend is not None:
            stream = DecodeStream(
                ids=list(context) or None, skip_special_tokens=skip_special_tokens
            )
            self._stream = (stream, backend)

    @property
    def uses_decode_stream(self) -> bool:
        return self._stream is not None

    @property
    def has_pending(self) -> bool:
        """True while some added tokens have not produced their text yet."""
        if self._pieces is not None:
            return bool(self._utf8.getstate()[0])
        return self._read_offset < len(self._ids)

    def add(self, token_id: int) -> str:
        """Add one token; return the text that became final ("" while a character is incomplete).

        Afterwards `last_token_start` tells where this token's own text starts, counted from the
        end of the text returned before this call (0 unless text was being held back).
        """
        held_before = self._held_text
        if self._pieces is not None:
            if not held_before:  # nothing pending: a token that is text alone is that text
                text = "" if token_id in self._skipped else self._pieces.text(token_id)
                if text is not None:
                    self.last_token_start = 0
                    return text
            piece = b"" if token_id in self._skipped else self._pieces.get(token_id)
            text = self._ready + self._utf8.decode(piece)
            pending = self._utf8.getstate()[0]
            if pending:  # hold the text before an unfinished character too, as DecodeStream does
                self._ready, self._held_text = text, text + pending.decode("utf-8", "replace")
                text = ""
            else:
                self._ready = self._held_text = ""
            self.last_token_start = (
                _shared_prefix(held_before, _stable(text or self._held_text)) if held_before else 0)
            return text
        self._ids.append(token_id)
        if not held_before and self._stream is not None:  # the common case, kept short
            try:
                chunk = self._stream[0].step(self._stream[1], token_id)
            except Exception:  # noqa: BLE001 - a decoder DecodeStream cannot follow: fall back
                self._stream = None
            else:
                self.last_token_start = 0
                if chunk:
                    self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                    return str(chunk)
                self._held_text = self._pending_text()
                return ""
        chunk = self._next_chunk(token_id)
        self._held_text = "" if chunk else self._pending_text()
        after = chunk or self._held_text
        self.last_token_start = _shared_prefix(held_before, _stable(after)) if held_before else 0
        return chunk

    def _next_chunk(self, token_id: int) -> str:
        if self._stream is not None:
            try:
                stream, backend = self._stream
                chunk = stream.step(backend, token_id)
            except Exception:  # noqa: BLE001 - a decoder DecodeStream cannot follow: fall back
                self._stream = None
            else:
                if chunk:
                    self._advance()
                return chunk or ""
        return self._window_step(final=False)

    def _pending_text(self) -> str:
        """The text of the held-back tokens as decoded now (may end in U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._decode(self._ids[self._prefix_offset :])[len(prefix_text) :]

    def flush(self) -> str:
        """Release whatever is still held back (an incomplete character decodes to U+FFFD)."""
        if self._pieces is not None:
            text, self._ready, self._held_text = self._ready, "", ""
            return text + self._utf8.decode(b"", final=True)
        text = self._window_step(final=True) if self.has_pending else ""
        self._held_text = ""
        self._stream = None  # the stream's own state is stale from here on
        return text

    def _window_step(self, *, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        unfinished = len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)
        if unfinished and not final:
            return ""
        self._advance()
        return new_text[len(prefix_text) :]

    def _advance(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)


def _stable(text: str) -> str:
    """`text` less a trailing U+FFFD: only the last one can be a character still incomplete
    (lossy UTF-8 decoding gives one U+FFFD per maximal invalid part, and earlier ones are
    followed by bytes that cannot complete them)."""
    return text[:-1] if text.endswith(REPLACEMENT_CHAR) else text


def _shared_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def complete_context(decode: Callable[[list[int]], str], ids: Sequence[int]) -> list[int]:
    """The last CONTEXT_TOKENS ids, cut back so that they do not end inside a character."""
    context = list(ids[-CONTEXT_TOKENS:])
    for _ in range(_MAX_CHAR_TOKENS):
        if not context or not decode(context).endswith(REPLACEMENT_CHAR):
            return context
        context.pop()
    return []


def _stream_backend(tokenizer: Any) -> Tokenizer | None:
    """The Rust tokenizer when DecodeStream decodes exactly like `tokenizer.decode`, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


def _decode_function(
    tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> Callable[[list[int]], str]:
    backend = _stream_backend(tokenizer)
    if backend is not None:  # same text as tokenizer.decode, without the Python wrapper's cost
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )
