"""The bytes each token adds to a byte-level BPE decode, for the detokenizer's fastest path.

A Rust tokenizer whose whole decoder is `ByteLevel` decodes ids by concatenating, per token
(special tokens left out when skipping them), the bytes of its characters under GPT-2's
byte-to-character map (the token's own UTF-8 bytes when a character is outside the map, as for
an added token like "<think>"), then reading the bytes as UTF-8 with U+FFFD for each invalid
part. So feeding these bytes to an incremental UTF-8 decoder gives exactly `tokenizer.decode`,
piece by piece, at the cost of a list lookup per token instead of two Rust decodes
(DecodeStream's step) — what every streamed token of Llama 3, Qwen2 and GPT-style models costs.

One `BytePieces` per tokenizer, shared by every request; entries are filled as tokens are seen.
An entry is kept as text when the token's bytes are valid UTF-8 on their own (most tokens):
with nothing pending, an incremental UTF-8 decoder turns them into exactly that text, so the
detokenizer returns it without decoding anything (`text`).
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders

from frontend.text.logprob_text import byte_level_bytes


class BytePieces:
    """Per-tokenizer cache: token id -> the bytes it adds to a decode."""

    def __init__(self, backend: Tokenizer) -> None:
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        size = backend.get_vocab_size(with_added_tokens=True)
        self._entries: list[str | bytes | None] = [None] * size  # str: valid UTF-8 alone

    @staticmethod
    def of(tokenizer: Any) -> BytePieces | None:
        """The pieces of `tokenizer` when its decode is the byte-level one described above
        (a Rust backend, a `ByteLevel` decoder alone, no clean-up of spaces), else None."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer) or not isinstance(backend.decoder,
                                                                 decoders.ByteLevel):
            return None
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return None
        return BytePieces(backend)

    def get(self, token_id: int) -> bytes:
        """The bytes of `token_id` in a decode that keeps special tokens (b"" for an id the
        tokenizer does not know, which decode leaves out)."""
        entry = self._entry(token_id)
        return entry.encode("utf-8") if isinstance(entry, str) else entry

    def text(self, token_id: int) -> str | None:
        """`get(token_id)` decoded, when those bytes are valid UTF-8 on their own; else None
        (a piece of a character, or bytes that are not UTF-8)."""
        entry = self._entry(token_id)
        return entry if isinstance(entry, str) else None

    def _entry(self, token_id: int) -> str | bytes:
        entries = self._entries
        if 0 <= token_id < len(entries):
            entry = entries[token_id]
            if entry is None:
                entry = entries[token_id] = self._compute(token_id)
            return entry
        return self._compute(token_id) if token_id >= 0 else ""

    def _compute(self, token_id: int) -> str | bytes:
        raw = self._raw(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw

    def _raw(self, token_id: int) -> bytes:
        token = self._backend.id_to_token(token_id)
        if token is None:
            return b""
        raw = byte_level_bytes(token)
        return token.encode("utf-8") if raw is None else raw
