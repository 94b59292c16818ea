"""Incremental detokenizer and logprob token strings, against the real tokenizers' decode."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import frontend.text.detokenizer as detokenizer_module
from frontend.text.byte_pieces import BytePieces
from frontend.text.detokenizer import IncrementalDetokenizer
from frontend.text.logprob_text import (
    TokenTextCache,
    _bytes_to_unicode,
    byte_level_bytes,
    bytes_repr,
)

TEXTS = [
    "Hello, world! How are you?",
    "你好世界🎉🚀",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🦜🫠 龘靐",
    "naïve café — 日本語テキスト",
    "안녕하세요 감사합니다",
    "  spaces\n\ttabs  ",
]
BYTE_CHAR = _bytes_to_unicode()


def byte_ids(tokenizer: Any, raw: bytes) -> list[int]:
    """One vocabulary token per byte (byte-level BPE has a token for every byte)."""
    return [tokenizer.convert_tokens_to_ids(BYTE_CHAR[b]) for b in raw]


def piece_id(tokenizer: Any, raw: bytes) -> int:
    """The vocabulary token standing for exactly `raw`."""
    token_id = tokenizer.convert_tokens_to_ids("".join(BYTE_CHAR[b] for b in raw))
    assert token_id != tokenizer.unk_token_id and token_id is not None
    return int(token_id)


def straddling_ids(tokenizer: Any) -> list[int]:
    """ "다한" with a middle token b"\\xa4\\xed" that ends 다 and starts 한."""
    return (
        byte_ids(tokenizer, b"\xeb\x8b")
        + [piece_id(tokenizer, b"\xa4\xed")]
        + byte_ids(tokenizer, b"\x95\x9c")
    )


MODES = ["bytes", "stream", "window"]  # BytePieces, DecodeStream, the decode window


def make(tokenizer: Any, mode: str = "stream", **kwargs: Any) -> IncrementalDetokenizer:
    """The detokenizer on one of its paths."""
    pieces = BytePieces.of(tokenizer) if mode == "bytes" else None
    assert pieces is not None or mode != "bytes"
    return IncrementalDetokenizer(tokenizer, use_decode_stream=mode == "stream", pieces=pieces,
                                  **kwargs)


def token_starts(detok: IncrementalDetokenizer, ids: list[int]) -> list[int]:
    """Where each token's own text starts in the whole text (`last_token_start` counts from
    the end of the text returned before the token)."""
    starts, returned = [], 0
    for token_id in ids:
        text = detok.add(token_id)
        starts.append(returned + detok.last_token_start)
        returned += len(text)
    return starts


def run(tokenizer: Any, ids: list[int], mode: str = "stream",
        **kwargs: Any) -> tuple[list[str], str]:
    detok = make(tokenizer, mode, **kwargs)
    chunks = [detok.add(i) for i in ids]
    return chunks, detok.flush()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", TEXTS)
def test_text_equals_decode(byte_bpe_tokenizer: Any, text: str, mode: str) -> None:
    ids = byte_bpe_tokenizer.encode(text, add_special_tokens=False)
    chunks, tail = run(byte_bpe_tokenizer, ids, mode=mode)
    assert "".join(chunks) == text == byte_bpe_tokenizer.decode(ids)
    assert tail == ""
    assert not any("\ufffd" in chunk for chunk in chunks)


@pytest.mark.parametrize("text", [*TEXTS, " Þ", "a🎉b"])
def test_every_path_returns_text_at_the_same_tokens(byte_bpe_tokenizer: Any, text: str) -> None:
    # a stop string is looked for in what add() returns: the paths must return the same chunks,
    # or one path ends a choice a token before another (" Þ" is b" \xc3" + b"\x9e" in Llama 3)
    ids = byte_bpe_tokenizer.encode(text, add_special_tokens=False)
    chunks = {mode: run(byte_bpe_tokenizer, ids, mode=mode) for mode in MODES}
    assert chunks["bytes"] == chunks["stream"] == chunks["window"]


def test_decode_stream_is_the_fast_path(byte_bpe_tokenizer: Any) -> None:
    assert IncrementalDetokenizer(byte_bpe_tokenizer).uses_decode_stream
    slow = IncrementalDetokenizer(byte_bpe_tokenizer, use_decode_stream=False)
    assert not slow.uses_decode_stream


@pytest.mark.parametrize("mode", MODES)
def test_partial_character_is_held_until_complete(
    llama3_tokenizer: Any, mode: str
) -> None:
    ids = llama3_tokenizer.encode("ab🎉", add_special_tokens=False)
    assert len(ids) >= 3, "the emoji should split over several byte tokens"
    chunks, tail = run(llama3_tokenizer, ids, mode=mode)
    assert chunks[-1].endswith("🎉")
    assert all(chunk == "" for chunk in chunks[-3:-1])
    assert tail == ""


@pytest.mark.parametrize("mode", MODES)
def test_token_completing_one_character_and_starting_the_next(
    byte_bpe_tokenizer: Any, mode: str
) -> None:
    ids = straddling_ids(byte_bpe_tokenizer)
    # 다 is complete once the straddling token arrives, but every path holds it with the start
    # of 한: the straddling token's text starts at 0, the next tokens' (pieces of 한) after 다
    assert token_starts(make(byte_bpe_tokenizer, mode), ids) == [0, 0, 0, 1, 1]
    assert run(byte_bpe_tokenizer, ids, mode=mode) == run(byte_bpe_tokenizer, ids, mode="window")
    assert "".join(run(byte_bpe_tokenizer, ids, mode=mode)[0]) == "다한"


@pytest.mark.parametrize("mode", MODES)
def test_incomplete_end_is_flushed_like_decode(
    llama3_tokenizer: Any, mode: str
) -> None:
    ids = llama3_tokenizer.encode("ok🎉", add_special_tokens=False)[:-1]  # stops mid-emoji
    chunks, tail = run(llama3_tokenizer, ids, mode=mode)
    assert "".join(chunks) == "ok"
    assert "".join(chunks) + tail == llama3_tokenizer.decode(ids)
    assert tail and set(tail) == {"\ufffd"}


@pytest.mark.parametrize("mode", MODES)
def test_text_after_invalid_bytes_starts_after_them(
    llama3_tokenizer: Any, mode: str
) -> None:
    ok = llama3_tokenizer.encode(" ok", add_special_tokens=False)
    ids = [*byte_ids(llama3_tokenizer, b"\x9c\xf0\x9f"), *ok]
    # \x9c can never be completed; \xf0\x9f is an emoji's start that " ok" leaves unfinished
    assert token_starts(make(llama3_tokenizer, mode), ids) == [0, 1, 1, 2]


@pytest.mark.parametrize("mode", MODES)
def test_a_lead_byte_cut_by_another_keeps_its_own_replacement(
    llama3_tokenizer: Any, mode: str
) -> None:
    # \xe4 starts a 3-byte character; the next \xe4 makes the first a final U+FFFD and starts
    # one of its own: decode gives "\ufffd\ufffd🎉", one character per token
    emoji = llama3_tokenizer.encode("🎉", add_special_tokens=False)
    ids = [*byte_ids(llama3_tokenizer, b"\xe4\xe4"), *emoji]
    assert llama3_tokenizer.decode(ids) == "\ufffd\ufffd🎉"
    assert token_starts(make(llama3_tokenizer, mode), ids)[:3] == [0, 1, 2]


@pytest.mark.parametrize("mode", MODES)
def test_context_ending_mid_character_does_not_leak(
    llama3_tokenizer: Any, mode: str
) -> None:
    ids = llama3_tokenizer.encode("say 🎉 now", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if llama3_tokenizer.decode(ids[:k]).endswith("\ufffd"))
    context, generated = ids[:cut], ids[cut:]
    chunks, tail = run(
        llama3_tokenizer, generated, context_ids=context, mode=mode
    )
    assert "".join(chunks) + tail == llama3_tokenizer.decode(generated)
    assert "🎉" not in "".join(chunks)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens_like_decode(
    llama3_tokenizer: Any, mode: str, skip: bool, spaces: bool
) -> None:
    tok = llama3_tokenizer
    ids = [tok.bos_token_id, *tok.encode("Hi", add_special_tokens=False), tok.eos_token_id]
    ids += [*tok.encode(" there 🎉", add_special_tokens=False)[:2], tok.eos_token_id]
    ids += tok.convert_tokens_to_ids(["<think>"]) + tok.encode("x", add_special_tokens=False)
    kwargs = {"skip_special_tokens": skip, "spaces_between_special_tokens": spaces}
    chunks, tail = run(tok, ids, mode=mode, **kwargs)
    assert "".join(chunks) + tail == tok.decode(ids, **kwargs)


def test_falls_back_when_decode_stream_fails(
    llama3_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    class FailingStream:
        def __init__(self, **_: Any) -> None:
            self.calls = 0

        def step(self, tokenizer: Any, token_id: int) -> str | None:
            raise RuntimeError("InvalidPrefix")

    monkeypatch.setattr(detokenizer_module, "DecodeStream", FailingStream)
    ids = llama3_tokenizer.encode("fall back 🎉 ok", add_special_tokens=False)
    chunks, tail = run(llama3_tokenizer, ids)
    assert "".join(chunks) + tail == "fall back 🎉 ok"


unicode_text = st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=24)


@settings(max_examples=100, deadline=None)
@given(texts=st.lists(unicode_text, min_size=1, max_size=3), cut=st.integers(0, 40))
@example(texts=["<|python_tag|>"], cut=0)  # a special token's text encodes to the token
@example(texts=["a<|im_end|>b", "<|python_tag|>"], cut=1)
def test_random_sequences_decode_like_decode(
    byte_bpe_tokenizer: Any, texts: list[str], cut: int
) -> None:
    # The detokenizer skips special tokens by default, as vLLM and OpenAI do, so the reference
    # is decode() skipping them too.
    tok = byte_bpe_tokenizer
    ids = [i for text in texts for i in tok.encode(text, add_special_tokens=False)]
    context, generated = ids[: min(cut, len(ids))], ids[min(cut, len(ids)) :]
    for mode in MODES:
        chunks, tail = run(tok, generated, context_ids=context, mode=mode)
        assert "".join(chunks) + tail == tok.decode(generated, skip_special_tokens=True)


# A token: raw bytes (one byte token each), text, or a special / added token by name.
byte_tokens = st.lists(st.one_of(st.binary(min_size=1, max_size=3),
                                 st.sampled_from([" ok", "你", "BOS", "EOS", "<think>"])),
                       max_size=16)


def token_ids(tokenizer: Any, tokens: list[bytes | str]) -> list[int]:
    named = {"BOS": tokenizer.bos_token_id, "EOS": tokenizer.eos_token_id,
             "<think>": tokenizer.convert_tokens_to_ids("<think>")}
    ids: list[int] = []
    for t in tokens:
        if isinstance(t, bytes):
            ids += byte_ids(tokenizer, t)
        elif t in named:
            ids.append(int(named[t]))
        else:
            ids += tokenizer.encode(t, add_special_tokens=False)
    return ids


@settings(max_examples=150, deadline=None)
@given(tokens=byte_tokens, skip=st.booleans())
@example(tokens=[b"\xed\xa0", b"\x80", b"\xf0\x9f", b"A", b"\xf4\x90\x80\x80"], skip=True)
@example(tokens=[b"\xe4", "BOS", b"\xbd\xa0", "<think>", b"\xc3"], skip=True)
def test_any_bytes_decode_like_decode(llama3_tokenizer: Any, tokens: list[bytes | str],
                                      skip: bool) -> None:
    """Invalid UTF-8 of every kind (lone continuation bytes, surrogates, cut sequences, bytes
    past U+10FFFF) and special tokens: every path gives the Rust decode's text."""
    ids = token_ids(llama3_tokenizer, tokens)
    expected = llama3_tokenizer.decode(ids, skip_special_tokens=skip)
    for mode in MODES:
        chunks, tail = run(llama3_tokenizer, ids, mode=mode, skip_special_tokens=skip)
        assert "".join(chunks) + tail == expected, mode


def test_sentencepiece_continuation_keeps_its_space() -> None:
    """Metaspace decoders drop the leading space of a sequence; with the prompt as context a
    continuation keeps it, as in decode(prompt + generated)."""
    vocab = {"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert tok.decode([1, 2, 3]) == "Hello world!" and tok.decode([2, 3]) == "world!"
    assert BytePieces.of(tok) is None  # not byte-level
    for mode in ("stream", "window"):
        chunks, _ = run(tok, [2, 3], context_ids=[1], mode=mode)
        assert "".join(chunks) == " world!"
        assert "".join(run(tok, [2, 3], mode=mode)[0]) == "world!"


# ---- logprob token strings -------------------------------------------------------------------


def test_token_strings_of_split_characters(llama3_tokenizer: Any) -> None:
    cache = TokenTextCache(llama3_tokenizer)
    ids = llama3_tokenizer.encode("你🎉", add_special_tokens=False)
    strings = [cache.get(i) for i in ids]
    assert strings[0] == "你"
    assert strings[1:] == ["bytes:\\xf0\\x9f", "bytes:\\x8e", "bytes:\\x89"]


def test_token_strings_are_never_empty_and_keep_every_byte(byte_bpe_tokenizer: Any) -> None:
    cache = TokenTextCache(byte_bpe_tokenizer)
    for text in TEXTS:
        ids = byte_bpe_tokenizer.encode(text, add_special_tokens=False)
        raw = b"".join(cache.raw_bytes(i) or b"" for i in ids)
        assert raw == text.encode("utf-8")
        for token_id in ids:
            string = cache.get(token_id)
            assert string
            if string.startswith("bytes:"):
                assert string == bytes_repr(cache.raw_bytes(token_id) or b"")
            else:
                assert string == byte_bpe_tokenizer.decode([token_id])


def test_special_token_strings(llama3_tokenizer: Any) -> None:
    cache = TokenTextCache(llama3_tokenizer)
    assert cache.get(llama3_tokenizer.eos_token_id) == "<｜end▁of▁sentence｜>"
    assert cache.get(llama3_tokenizer.bos_token_id) == "<｜begin▁of▁sentence｜>"


def test_bytes_repr_is_lowercase_escaped_hex() -> None:
    assert bytes_repr(b"\xe4\xbd") == "bytes:\\xe4\\xbd"
    assert bytes_repr(b" \xe9") == "bytes:\\x20\\xe9"


def test_byte_level_bytes_reads_every_piece_of_a_vocabulary(llama3_tokenizer: Any) -> None:
    """Each character of a byte-level piece is one byte under GPT-2's map; a piece with any
    other character (an added token's own text) is not byte-level."""
    unicode_to_byte = {ch: b for b, ch in BYTE_CHAR.items()}
    backend = llama3_tokenizer.backend_tokenizer
    pieces = [backend.id_to_token(i) for i in range(backend.get_vocab_size())]
    pieces += ["a b", "\x85", "é", "<think>", "ĠĀ", ""]
    for piece in pieces:
        want = (bytes(unicode_to_byte[ch] for ch in piece)
                if all(ch in unicode_to_byte for ch in piece) else None)
        assert byte_level_bytes(piece) == want, piece
