"""Token strings for logprobs, following OpenAI's conventions.

A token's string is its text as the tokenizer decodes it alone, special tokens included
(e.g. "<｜end▁of▁sentence｜>"). A token that is not valid text on its own — one piece of a
multi-byte UTF-8 character — is written "bytes:" followed by its raw bytes as literal
lowercase `\\xNN` escapes, e.g. "bytes:\\xe4\\xbd". Token strings are never empty for tokens
that carry bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTENCEPIECE_SPACE = "\u2581"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character (byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_TO_UNICODE: Mapping[int, str] = MappingProxyType(_bytes_to_unicode())
UNICODE_TO_BYTE: Mapping[str, int] = MappingProxyType(
    {ch: b for b, ch in BYTE_TO_UNICODE.items()}
)
# str.translate tables: a byte-level piece's characters to the code points 0-255 of their bytes,
# and every byte-level character deleted (what is left of a piece is not byte-level).
_TO_BYTES = str.maketrans({ch: b for ch, b in UNICODE_TO_BYTE.items()})
_DROP_BYTE_CHARS = str.maketrans(dict.fromkeys(UNICODE_TO_BYTE))


def byte_level_bytes(piece: str) -> bytes | None:
    """The bytes a byte-level BPE piece stands for (each character one byte under GPT-2's map),
    or None when a character of it is not in the map (e.g. an added token's own text)."""
    if piece.translate(_DROP_BYTE_CHARS):
        return None
    return piece.translate(_TO_BYTES).encode("latin-1")


def bytes_repr(raw: bytes) -> str:
    """OpenAI's spelling of a token that is not text on its own: bytes:\\xNN\\xNN..."""
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def token_id_repr(token_id: int) -> str:
    """The token string used with return_tokens_as_token_ids."""
    return f"token_id:{token_id}"


def first_wins(keys: Iterable[str], values: Iterable[float]) -> dict[str, float]:
    """Top alternatives by string when two ids may share one: the first (likelier) value
    counts (where `dict(zip(...))` would keep the last)."""
    top: dict[str, float] = {}
    for key, value in zip(keys, values):
        top.setdefault(key, value)
    return top


class TokenTextCache:
    """Per-tokenizer cache of logprob token strings; share one across requests.

    Entries never change for a given tokenizer, so the cache is a list indexed by token id,
    bounded by the vocabulary size: less memory than a dict of the same entries, which counts
    in a frontend (docs/benchmarks.md, "Frontend memory"). Ids outside the tokenizer's
    vocabulary are computed each time.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and "ByteLevel" in str(backend.decoder)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added_ids = frozenset(added)
        self._cache: list[str | None] = [None] * len(tokenizer)

    def get(self, token_id: int) -> str:
        """The logprob string of `token_id` (decoded alone, or bytes:... when not text)."""
        cache = self._cache
        if 0 <= token_id < len(cache):
            text = cache[token_id]
            if text is None:
                text = cache[token_id] = self._compute(token_id)
            return text
        return self._compute(token_id)

    def strings(self, token_ids: Sequence[int]) -> list[str]:
        """`get` of each id (for a row of top alternatives, at the cost of one lookup)."""
        try:
            found = list(map(self._cache.__getitem__, token_ids))
        except (IndexError, TypeError):  # an id outside the vocabulary (or not an int)
            return [self.get(int(i)) for i in token_ids]
        if None in found:
            return [self.get(int(i)) for i in token_ids]
        return found  # type: ignore[return-value]  # no None left

    def top_dict(self, token: str, value: float, ids: Sequence[int],
                 values: Sequence[float]) -> dict[str, float]:
        """A token's top alternatives by string (OpenAI's `top_logprobs` entry), the token
        itself added when it is not among them; when two ids have the same string, the first
        (likelier) one's value counts. In one pass when every string is cached and distinct."""
        top: dict[str | None, float]
        try:
            top = dict(zip(map(self._cache.__getitem__, ids), values))
        except (IndexError, TypeError):  # an id outside the vocabulary (or not an int)
            top = {}
        if len(top) < len(ids) or None in top:  # a string twice, or one not cached yet
            top = first_wins(self.strings(ids), values)  # type: ignore[assignment]
        top.setdefault(token, value)
        return top  # type: ignore[return-value]  # no None left

    def _compute(self, token_id: int) -> str:
        text: str = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if token_id in self._added_ids or (text and "\ufffd" not in text):
            return text
        raw = self.raw_bytes(token_id)
        if not raw:
            return text
        try:
            return raw.decode("utf-8")  # e.g. the token for U+FFFD itself, or "▁" alone
        except UnicodeDecodeError:
            return bytes_repr(raw)

    def raw_bytes(self, token_id: int) -> bytes | None:
        """The bytes a vocabulary token stands for, or None when they cannot be told."""
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        if self._byte_level and (raw := byte_level_bytes(piece)) is not None:
            return raw
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return piece.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8")
