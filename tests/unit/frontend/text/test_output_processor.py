"""ChoiceProcessor: synthetic engine outputs (real token ids, fake logprobs) in, deltas out.

`full` is the concatenation of a choice's delta texts; the checks are the text-offset contract
of docs/architecture.md, decode equality, and stream == non-stream (merging deltas, however
steps are grouped).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from frontend.text.byte_pieces import BytePieces
from frontend.text.output_processor import (
    ChoiceDelta,
    ChoiceProcessor,
    OutputOptions,
    merge_deltas,
)
from shared.step_outputs import PromptRows, TokenLogprob
from tests.unit.frontend.text.test_detokenizer import straddling_ids

REPLACEMENT = "\ufffd"
FILLER_IDS = (15, 16, 17)  # "0", "1", "2" in both vocabularies: top-k alternatives


def fake_logprob(token_id: int, i: int, k: int = 2) -> TokenLogprob:
    """Sampled token first among its top-k (as greedy sampling would give)."""
    top_ids = [token_id, *FILLER_IDS][:k]
    value = -0.1 * (i + 1)
    return TokenLogprob(value, 1, top_ids, [value - j for j in range(len(top_ids))])


def fake_prompt_view(prompt_ids: Sequence[int], k: int = 2,
                     columns: bool = True) -> Sequence[TokenLogprob]:
    """Prompt logprobs as the engine client hands them over (PromptRows, whose columns the
    processor reads at once), or with `columns=False` as a plain list of rows (read one by one):
    both must give the same deltas."""
    rows = [
        TokenLogprob(-1.0 - r, 3, list(FILLER_IDS[:k]), [-0.5 - j for j in range(k)])
        for r in range(len(prompt_ids) - 1)
    ]
    if not columns:
        return rows
    return PromptRows([r.logprob for r in rows], [r.rank for r in rows],
                      [i for r in rows for i in r.top_ids],
                      [v for r in rows for v in r.top_logprobs], k)


def run_choice(
    tokenizer: Any,
    prompt_ids: Sequence[int],
    generated: Sequence[int],
    options: OutputOptions,
    *,
    finish: str = "length",
    stop_token_id: int | None = None,
    idle_before: frozenset[int] = frozenset(),
    pieces: BytePieces | None = None,
    columns: bool = True,
) -> tuple[ChoiceProcessor, list[ChoiceDelta]]:
    """Feed one choice as the engine would; `idle_before` adds token-less steps."""
    proc = ChoiceProcessor(tokenizer, list(prompt_ids), options, pieces=pieces)
    k = options.logprobs or 0
    deltas = [proc.prompt(fake_prompt_view(prompt_ids, k, columns) if options.echo else None)]
    for i, token_id in enumerate(generated):
        if i in idle_before:
            deltas.append(proc.step(None, None, None))
        last = i == len(generated) - 1
        deltas.append(
            proc.step(
                token_id,
                fake_logprob(token_id, i, k),
                finish if last else None,
                stop_token_id if last else None,
            )
        )
        if proc.finished:
            break
    if not generated:
        deltas.append(proc.step(None, None, finish))
    return proc, deltas


def run_merged(
    tokenizer: Any,
    prompt_ids: Sequence[int],
    generated: Sequence[int],
    options: OutputOptions,
    cuts: frozenset[int],
    *,
    finish: str = "length",
    pieces: BytePieces | None = None,
) -> list[ChoiceDelta]:
    """The same choice fed as a stream that fell behind does it: several steps (the prompt
    with the first) and one delta, taken only after the steps in `cuts` (and at the end)."""
    proc = ChoiceProcessor(tokenizer, list(prompt_ids), options, pieces=pieces)
    k = options.logprobs or 0
    proc.feed_prompt(fake_prompt_view(prompt_ids, k) if options.echo else None)
    deltas = []
    for i, token_id in enumerate(generated):
        last = i == len(generated) - 1
        proc.feed(token_id, fake_logprob(token_id, i, k), finish if last else None)
        if i in cuts or last:
            deltas.append(proc.delta())
    if not generated:
        proc.feed(None, None, finish)
    deltas.append(proc.delta())
    assert not proc.delta().finish_reason  # the finish goes out once
    return deltas


def assert_offsets_contract(
    full: str,
    tokens: Sequence[str],
    offsets: Sequence[int],
    *,
    echo: bool,
    skip: Sequence[str] = (),
    cut: bool = False,
) -> None:
    """The text offsets (docs/architecture.md): non-decreasing indexes into `full`, 0 first
    with echo, and a token that decodes alone starts where its offset says (or is cut at the
    very end)."""
    assert len(tokens) == len(offsets)
    assert list(offsets) == sorted(offsets)
    assert all(0 <= o <= len(full) for o in offsets)
    if echo and offsets:
        assert offsets[0] == 0
    for token, offset in zip(tokens, offsets):
        if token.startswith(("bytes:", "token_id:")) or token in skip:
            continue
        rest = full[offset:]
        assert rest.startswith(token) or (cut and token.startswith(rest)), (token, offset, rest)


def assert_stream_shape(deltas: Sequence[ChoiceDelta]) -> None:
    """Entries travel with text, except in the final delta; only the final delta finishes."""
    for delta in deltas[:-1]:
        assert delta.finish_reason is None
        if delta.token_ids or delta.tokens:
            assert delta.text
    assert deltas[-1].finish_reason is not None


def expected_offsets(tokenizer: Any, ids: Sequence[int], base: int, end: int) -> list[int]:
    """Oracle for valid text: token k starts after the complete characters of ids[:k]."""
    text = [tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids))]
    return [min(base + len(t.rstrip(REPLACEMENT)), end) for t in text]


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


TEXTS = ["Hello, world! How are you?", "你好世界🎉🚀", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🦜🫠 龘靐", "안녕하세요 감사합니다"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("echo", [False, True])
def test_text_and_offsets(byte_bpe_tokenizer: Any, text: str, echo: bool) -> None:
    tok = byte_bpe_tokenizer
    prompt = list(tok.encode("Prompt: 日本語"))
    generated = encode(tok, text)
    proc, deltas = run_choice(tok, prompt, generated, OutputOptions(echo=echo, logprobs=2))
    out = merge_deltas(deltas)
    prompt_text = tok.decode(prompt, skip_special_tokens=True) if echo else ""
    assert out.text == prompt_text + tok.decode(generated)
    assert out.token_ids == generated
    assert out.finish_reason == "length" and proc.num_generated_tokens == len(generated)
    assert len(out.tokens) == len(generated) + (len(prompt) if echo else 0)
    assert_offsets_contract(out.text, out.tokens, out.text_offset, echo=echo, skip=[tok.bos_token])
    assert out.text_offset == (expected_offsets(tok, prompt, 0, len(out.text)) if echo else []) + (
        expected_offsets(tok, generated, len(prompt_text), len(out.text))
    )
    assert_stream_shape(deltas)


def test_echo_with_bos_and_prompt_logprobs(llama3_tokenizer: Any) -> None:
    tok = llama3_tokenizer
    prompt = list(tok.encode("Hi 🎉"))
    assert prompt[0] == tok.bos_token_id
    options = OutputOptions(echo=True, logprobs=1)
    _, deltas = run_choice(tok, prompt, encode(tok, " yes"), options)
    first = deltas[0]
    assert first.text == "Hi 🎉" and first.token_ids == []
    assert first.tokens[0] == "<｜begin▁of▁sentence｜>"
    assert first.token_logprobs[0] is None and first.top_logprobs[0] is None
    # BOS owns nothing; " \xf0\x9f" owns the space, the emoji (its last token's) starts at 3
    assert list(first.text_offset) == [0, 0, 2, 3, 3]
    assert list(first.token_logprobs[1:]) == [-1.0, -2.0, -3.0, -4.0]
    assert first.top_logprobs[1] == {"0": -0.5, "Hi": -1.0}  # top-1 plus the prompt token
    out = merge_deltas(deltas)
    assert out.text == "Hi 🎉 yes" and out.text_offset[-1] == 4


def test_echo_keeps_special_tokens_when_asked(llama3_tokenizer: Any) -> None:
    tok = llama3_tokenizer
    options = OutputOptions(echo=True, logprobs=0, skip_special_tokens=False)
    _, deltas = run_choice(tok, tok.encode("Hi"), encode(tok, "!"), options)
    out = merge_deltas(deltas)
    assert out.text == "<｜begin▁of▁sentence｜>Hi!"
    assert out.text_offset == [0, len("<｜begin▁of▁sentence｜>"), len(out.text) - 1]
    assert_offsets_contract(out.text, out.tokens, out.text_offset, echo=True)


@pytest.mark.parametrize("include", [False, True])
def test_eos_ends_with_an_entry_and_no_text(byte_bpe_tokenizer: Any, include: bool) -> None:
    tok = byte_bpe_tokenizer
    generated = [*encode(tok, "Done 🎉"), tok.eos_token_id]
    options = OutputOptions(logprobs=1, include_stop_str_in_output=include)
    proc, deltas = run_choice(tok, tok.encode("Q"), generated, options, finish="stop")
    out = merge_deltas(deltas)
    assert out.text == "Done 🎉"  # EOS is a special token: no text either way
    assert out.tokens[-1] == "<｜end▁of▁sentence｜>" and out.text_offset[-1] == len(out.text)
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == generated and proc.num_generated_tokens == len(generated)
    assert deltas[-1].text == "" and deltas[-1].tokens == ["<｜end▁of▁sentence｜>"]
    assert_stream_shape(deltas)


def test_eos_after_an_unfinished_character(llama3_tokenizer: Any) -> None:
    tok = llama3_tokenizer
    generated = [*encode(tok, "ok🎉")[:-1], tok.eos_token_id]
    _, deltas = run_choice(tok, [1], generated, OutputOptions(logprobs=0), finish="stop")
    out = merge_deltas(deltas)
    assert out.text == tok.decode(generated, skip_special_tokens=True) == "ok\ufffd"
    assert out.text_offset == [0, 2, 2, 3]  # the unfinished bytes come before the EOS


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id_text_only_with_include(llama3_tokenizer: Any, include: bool) -> None:
    tok = llama3_tokenizer
    newline = encode(tok, "\n")[0]
    generated = [*encode(tok, "line one"), newline]
    options = OutputOptions(include_stop_str_in_output=include)
    _, deltas = run_choice(tok, [1], generated, options, finish="stop", stop_token_id=newline)
    out = merge_deltas(deltas)
    assert out.text == "line one" + ("\n" if include else "")
    assert (out.finish_reason, out.stop_reason) == ("stop", newline)


def test_stop_string_spanning_tokens(byte_bpe_tokenizer: Any) -> None:
    tok = byte_bpe_tokenizer
    generated = encode(tok, "Hello, world! STOP here and more")
    options = OutputOptions(logprobs=0, stop=("d! ST",))
    proc, deltas = run_choice(tok, [1], generated, options)
    out = merge_deltas(deltas)
    assert out.text == "Hello, worl"
    assert (out.finish_reason, out.stop_reason) == ("stop", "d! ST")
    assert proc.stopped_by_string and proc.finished
    assert out.tokens == [tok.decode([i]) for i in encode(tok, "Hello, world! STOP")]
    assert proc.num_generated_tokens == len(out.tokens)
    assert_offsets_contract(out.text, out.tokens, out.text_offset, echo=False, cut=True)
    assert all("d" not in d.text for d in deltas)  # the stop string's start was held back
    assert proc.step(generated[0], None, None) == ChoiceDelta()  # in flight after the abort
    assert_stream_shape(deltas)


def test_stop_string_at_the_very_end_wins_over_length(llama3_tokenizer: Any) -> None:
    tok = llama3_tokenizer
    _, deltas = run_choice(tok, [1], encode(tok, "one two STOP"), OutputOptions(stop=("STOP",)))
    out = merge_deltas(deltas)
    assert (out.text, out.finish_reason, out.stop_reason) == ("one two ", "stop", "STOP")


def test_several_stop_strings_and_include(qwen2_tokenizer: Any) -> None:
    tok = qwen2_tokenizer
    options = OutputOptions(logprobs=1, stop=("world", "lo, w"), include_stop_str_in_output=True)
    _, deltas = run_choice(tok, [1], encode(tok, "Hello, world! Bye"), options)
    out = merge_deltas(deltas)
    assert (out.text, out.stop_reason) == ("Hello, w", "lo, w")
    assert_offsets_contract(out.text, out.tokens, out.text_offset, echo=False, cut=True)


def test_held_back_text_that_does_not_match_is_flushed(llama3_tokenizer: Any) -> None:
    tok = llama3_tokenizer
    _, deltas = run_choice(tok, [1], encode(tok, "ends with STO"), OutputOptions(stop=("STOP",)))
    assert merge_deltas(deltas).text == "ends with STO"
    assert deltas[-1].text.endswith("STO")


def test_choices_are_independent(llama3_tokenizer: Any) -> None:
    tok = llama3_tokenizer
    prompt = tok.encode("Pick:")
    options = OutputOptions(logprobs=1, stop=("!",))
    a, b = ChoiceProcessor(tok, prompt, options), ChoiceProcessor(tok, prompt, options)
    ids_a, ids_b = encode(tok, "你好 yes! no"), encode(tok, "🎉 maybe")
    out_a, out_b = [a.prompt(None)], [b.prompt(None)]
    for i in range(max(len(ids_a), len(ids_b))):
        if i < len(ids_a) and not a.finished:
            out_a.append(a.step(ids_a[i], fake_logprob(ids_a[i], i, 1), None))
        if i < len(ids_b):
            finish = "length" if i == len(ids_b) - 1 else None
            out_b.append(b.step(ids_b[i], fake_logprob(ids_b[i], i, 1), finish))
    assert merge_deltas(out_a).text == "你好 yes" and a.stopped_by_string
    assert merge_deltas(out_b).text == "🎉 maybe" and not b.stopped_by_string
    assert merge_deltas(out_b).token_ids == ids_b


def test_prompt_only(byte_bpe_tokenizer: Any) -> None:
    tok = byte_bpe_tokenizer
    prompt = list(tok.encode("Echo me 🎉"))
    proc = ChoiceProcessor(tok, prompt, OutputOptions(echo=True, logprobs=1))
    first = proc.prompt(fake_prompt_view(prompt, 1))
    last = proc.step(None, None, "length")
    assert first.text == tok.decode(prompt, skip_special_tokens=True)
    assert first.finish_reason is None
    assert len(first.tokens) == len(prompt) and first.token_ids == []
    assert (last.text, list(last.tokens), last.finish_reason) == ("", [], "length")
    assert proc.num_generated_tokens == 0 and proc.finished


def test_prompt_of_special_tokens_only_keeps_its_entry_for_the_text(llama3_tokenizer: Any) -> None:
    tok = llama3_tokenizer
    options = OutputOptions(echo=True, logprobs=0)
    _, deltas = run_choice(tok, [tok.bos_token_id], encode(tok, "Hi"), options)
    assert deltas[0] == ChoiceDelta()  # no text yet, so no entry either
    assert deltas[1].text == "Hi" and list(deltas[1].text_offset) == [0, 0]


def test_token_id_prompt_ending_mid_character(byte_bpe_tokenizer: Any) -> None:
    tok = byte_bpe_tokenizer
    ids = encode(tok, "say 🦜 ok")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(REPLACEMENT))
    prompt, generated = ids[:cut], ids[cut:]
    for echo in (False, True):
        _, deltas = run_choice(tok, prompt, generated, OutputOptions(echo=echo, logprobs=1))
        out = merge_deltas(deltas)
        assert out.text == (tok.decode(prompt) if echo else "") + tok.decode(generated)
        assert "🦜" not in out.text
        assert_offsets_contract(out.text, out.tokens, out.text_offset, echo=echo)


def test_token_completing_a_character_owns_it(byte_bpe_tokenizer: Any) -> None:
    tok = byte_bpe_tokenizer
    generated = straddling_ids(tok)  # "다한": 2 bytes, (end of 다 + start of 한), 2 bytes
    _, deltas = run_choice(tok, [1], generated, OutputOptions(logprobs=0))
    out = merge_deltas(deltas)
    assert out.text == "다한"
    assert out.text_offset == [0, 0, 0, 1, 1]


def test_return_tokens_as_token_ids(llama3_tokenizer: Any) -> None:
    tok = llama3_tokenizer
    generated = encode(tok, "a🎉")
    plain = merge_deltas(run_choice(tok, [1], generated, OutputOptions(logprobs=2))[1])
    options = OutputOptions(logprobs=2, return_tokens_as_token_ids=True)
    as_ids = merge_deltas(run_choice(tok, [1], generated, options)[1])
    assert as_ids.tokens == [f"token_id:{i}" for i in generated]
    assert as_ids.text_offset == plain.text_offset and as_ids.text == plain.text
    assert as_ids.top_logprobs[0] == {f"token_id:{generated[0]}": -0.1, "token_id:15": -1.1}


def test_top_logprobs_have_k_or_k_plus_one_entries(llama3_tokenizer: Any) -> None:
    tok = llama3_tokenizer
    token_id = encode(tok, "Hi")[0]
    proc = ChoiceProcessor(tok, [1], OutputOptions(logprobs=0))
    assert proc.step(token_id, TokenLogprob(-0.3, 1, [], []), None).top_logprobs == [{"Hi": -0.3}]
    proc = ChoiceProcessor(tok, [1], OutputOptions(logprobs=2))
    delta = proc.step(token_id, TokenLogprob(-2.0, 3, [15, 16], [-0.5, -1.0]), None)
    assert delta.top_logprobs == [{"0": -0.5, "1": -1.0, "Hi": -2.0}]
    assert delta.tokens == ["Hi"] and delta.token_logprobs == [-2.0]


@pytest.mark.parametrize("as_ids", [False, True])
def test_prompt_columns_read_like_rows(llama3_tokenizer: Any, as_ids: bool) -> None:
    """The echo's bulk path over PromptRows: rows wider than k are cut to k, a string twice
    among the alternatives keeps the first (likelier) value, the prompt token is added when
    it is not among them; exactly what reading the same rows one by one gives."""
    tok = llama3_tokenizer
    prompt = list(tok.encode("Hi 🎉 there"))
    twice = tok.convert_tokens_to_ids(["Hi", "0"])
    n = len(prompt) - 1
    top_ids = [twice[0], twice[0], twice[1]] * n  # width 3; k=2 keeps the duplicate pair
    values = [-0.5, -0.7, -0.9] * n
    columns = PromptRows([-1.0 - r for r in range(n)], [2] * n, top_ids, values, 3)
    options = OutputOptions(echo=True, logprobs=2, return_tokens_as_token_ids=as_ids)
    deltas = {}
    for form in ("columns", "rows"):
        proc = ChoiceProcessor(tok, prompt, options)
        deltas[form] = proc.prompt(columns if form == "columns" else list(columns))
    assert deltas["columns"] == deltas["rows"]
    top = deltas["columns"].top_logprobs
    assert top[0] is None and len(top) == len(prompt)
    hi = f"token_id:{twice[0]}" if as_ids else "Hi"
    assert top[1] == {hi: -0.5}  # the prompt token (Hi) is among them
    assert top[2] is not None and top[2][hi] == -0.5 and len(top[2]) == 2  # + the prompt token


def test_no_logprobs_means_empty_logprob_lists(llama3_tokenizer: Any) -> None:
    tok = llama3_tokenizer
    _, deltas = run_choice(tok, [1], encode(tok, "plain"), OutputOptions(echo=True))
    out = merge_deltas(deltas)
    assert out.tokens == [] and out.text_offset == [] and out.token_ids == encode(tok, "plain")


unicode_text = st.text(st.characters(codec="utf-8", exclude_characters=REPLACEMENT), max_size=20)


@settings(max_examples=100, deadline=None)
@example(prompt_text="", text=" Þ", stop=" ", echo=False, eos=False, idle=frozenset())
@given(
    prompt_text=unicode_text,
    text=unicode_text,
    stop=st.sampled_from(["", " ", "a", "é", "🎉"]),
    echo=st.booleans(),
    eos=st.booleans(),
    idle=st.frozensets(st.integers(0, 30), max_size=5),
)
def test_random_sequences(
    byte_bpe_tokenizer: Any,
    prompt_text: str,
    text: str,
    stop: str,
    echo: bool,
    eos: bool,
    idle: frozenset[int],
) -> None:
    tok = byte_bpe_tokenizer
    prompt = list(tok.encode(prompt_text))
    generated = encode(tok, text) + ([tok.eos_token_id] if eos else [])
    options = OutputOptions(echo=echo, logprobs=1, stop=(stop,) if stop else ())
    finish = "stop" if eos else "length"
    proc, deltas = run_choice(tok, prompt, generated, options, finish=finish)
    _, grouped = run_choice(tok, prompt, generated, options, finish=finish, idle_before=idle)
    out = merge_deltas(deltas)
    assert merge_deltas(grouped) == out  # grouping of steps does not matter
    pieces = BytePieces.of(tok)
    assert pieces is not None
    _, byte_path = run_choice(tok, prompt, generated, options, finish=finish, pieces=pieces)
    assert merge_deltas(byte_path) == out  # nor the detokenizer's path
    _, by_rows = run_choice(tok, prompt, generated, options, finish=finish, columns=False)
    assert by_rows == deltas  # nor whether the prompt's logprobs come as columns or rows
    for path in (None, pieces):  # nor a consumer that fell behind: merged steps, one delta
        merged = run_merged(tok, prompt, generated, options, idle, finish=finish, pieces=path)
        assert merge_deltas(merged) == out
        assert_stream_shape([d for d in merged if not d.is_empty] or merged[-1:])
    prompt_text_out = tok.decode(prompt, skip_special_tokens=True) if echo else ""
    generated_text = tok.decode(generated, skip_special_tokens=True)
    if stop and stop in generated_text:
        generated_text = generated_text[: generated_text.index(stop)]
        assert proc.stopped_by_string and out.stop_reason == stop
    assert out.text == prompt_text_out + generated_text
    released = generated[: proc.num_generated_tokens]
    assert out.token_ids == released
    assert out.text_offset == (expected_offsets(tok, prompt, 0, len(out.text)) if echo else []) + (
        expected_offsets(tok, released, len(prompt_text_out), len(out.text))
    )
    specials = [tok.bos_token, tok.eos_token]
    assert_offsets_contract(
        out.text, out.tokens, out.text_offset, echo=echo, skip=specials, cut=True
    )
    assert_stream_shape(deltas)
    # Without logprobs nor generated tokens kept (the cheapest path), the same text, merged or
    # not, on either detokenizer path.
    bare = OutputOptions(echo=echo, stop=options.stop, generated_tokens=False)
    for path in (None, pieces):
        for cuts in (frozenset(range(len(generated))), idle):
            bare_out = merge_deltas(run_merged(tok, prompt, generated, bare, cuts, finish=finish,
                                               pieces=path))
            assert (bare_out.text, bare_out.finish_reason) == (out.text, out.finish_reason)
            assert bare_out.generated == bare_out.tokens == []
