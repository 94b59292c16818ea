"""The dataset loaders (random, sharegpt, custom, prefix_repetition) on the real tokenizers and
the shipped sample files, with vLLM's length rules checked by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from frontend.bench.datasets import (
    REPEAT_INSTRUCTION,
    DatasetConfig,
    Pair,
    custom_rows,
    is_word,
    length_range,
    sample_prompts,
    sharegpt_pairs,
    sharegpt_prompts,
)
from frontend.bench.workload import count_tokens

DATA = Path(__file__).parents[3] / "data" / "bench"
SHAREGPT = str(DATA / "sharegpt_sample.json")
CUSTOM = str(DATA / "custom_sample.jsonl")


def test_length_range_is_vllms_floor_ceil_interval() -> None:
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(10, 0.25) == (7, 13)  # floor(7.5), ceil(12.5)
    assert length_range(3, 0.9, minimum=1) == (1, 6)  # floor(0.3) = 0 -> 1, ceil(5.7)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            length_range(10, bad)


def test_random_lengths_stay_in_range_and_prompts_are_exact(llama3_tokenizer: Any) -> None:
    config = DatasetConfig(random_input_len=20, random_output_len=10, random_range_ratio=0.5)
    prompts = sample_prompts(llama3_tokenizer, config, 40, seed=3)
    assert len(prompts) == 40
    assert all(10 <= p.input_len <= 30 and 5 <= p.output_len <= 15 for p in prompts)
    assert len({p.input_len for p in prompts}) > 5  # the lengths do vary
    assert all(count_tokens(llama3_tokenizer, p.text) == p.input_len for p in prompts)
    assert prompts == sample_prompts(llama3_tokenizer, config, 40, seed=3)


def test_random_prefix_is_shared_and_counted(byte_bpe_tokenizer: Any) -> None:
    config = DatasetConfig(random_input_len=8, random_output_len=4, random_prefix_len=16)
    prompts = sample_prompts(byte_bpe_tokenizer, config, 6, seed=1)
    first = prompts[0].text
    prefix = next(i for i in range(len(first)) if any(p.text[i] != first[i] for p in prompts))
    assert count_tokens(byte_bpe_tokenizer, first[:prefix]) >= 15  # the shared text
    for p in prompts:
        assert p.input_len == 24 == count_tokens(byte_bpe_tokenizer, p.text)
        assert p.output_len == 4


def test_random_needs_a_token(llama3_tokenizer: Any) -> None:
    config = DatasetConfig(random_input_len=1, random_range_ratio=0.5)
    with pytest.raises(ValueError, match="every prompt needs a token"):
        sample_prompts(llama3_tokenizer, config, 2, seed=0)


def test_prefix_repetition_shares_each_prefix(llama3_tokenizer: Any) -> None:
    config = DatasetConfig(
        name="prefix_repetition",
        prefix_repetition_prefix_len=12,
        prefix_repetition_suffix_len=5,
        prefix_repetition_num_prefixes=3,
        prefix_repetition_output_len=7,
    )
    prompts = sample_prompts(llama3_tokenizer, config, 10, seed=2)  # 10 // 3 = 3 per prefix
    assert len(prompts) == 9 and len({p.text for p in prompts}) == 9
    assert {(p.input_len, p.output_len) for p in prompts} == {(17, 7)}
    assert all(count_tokens(llama3_tokenizer, p.text) == 17 for p in prompts)
    heads = [p.text[:20] for p in prompts]
    assert sorted(heads.count(h) for h in set(heads)) == [3, 3, 3]
    with pytest.raises(ValueError, match="num-prefixes"):
        sample_prompts(llama3_tokenizer, config, 2, seed=2)


def test_sharegpt_sample_keeps_first_human_turn_and_answer_length(llama3_tokenizer: Any) -> None:
    config = DatasetConfig(name="sharegpt", path=SHAREGPT)
    prompts = sample_prompts(llama3_tokenizer, config, 5, seed=0)
    texts = {p.text for p in prompts}
    # 7 entries: "Hi" is too short, one has no answer; the system turn is skipped.
    assert len(texts) == 5 and "Hi" not in texts
    assert "Explain in two sentences why the sky looks blue during the day." in texts
    data = json.loads(Path(SHAREGPT).read_text())
    (haiku_entry,) = [e for e in data if e["id"] == "made-up-3"]
    answer = haiku_entry["conversations"][1]["value"]
    haiku = next(p for p in prompts if p.text.startswith("Write a haiku"))
    assert haiku.output_len == count_tokens(llama3_tokenizer, answer)
    assert haiku.input_len == count_tokens(llama3_tokenizer, haiku.text)


def test_sharegpt_cycles_and_fixed_output_len(llama3_tokenizer: Any) -> None:
    config = DatasetConfig(name="sharegpt", path=SHAREGPT, sharegpt_output_len=3)
    prompts = sample_prompts(llama3_tokenizer, config, 12, seed=0)
    assert len(prompts) == 12 and prompts[:5] == prompts[5:10]
    assert {p.output_len for p in prompts} == {3}
    assert prompts == sample_prompts(llama3_tokenizer, config, 12, seed=0)
    assert prompts != sample_prompts(llama3_tokenizer, config, 12, seed=1)  # shuffled by seed


def test_sharegpt_length_rules(llama3_tokenizer: Any) -> None:
    long_prompt = "word " * 1100
    kept = "please tell me more now"
    pairs = [Pair(kept, "sure thing, here it is"), Pair(long_prompt, "fine, here it is")]
    # the 1,100-token prompt is over vLLM's 1,024: the one usable pair is repeated
    assert [p.text for p in sharegpt_prompts(llama3_tokenizer, pairs, 2, None)] == [kept, kept]
    short_answer = [Pair("tell me something please", "no")]
    with pytest.raises(ValueError, match="no usable ShareGPT"):
        sharegpt_prompts(llama3_tokenizer, short_answer, 1, None)
    assert sharegpt_prompts(llama3_tokenizer, short_answer, 1, 5)[0].output_len == 5


def test_sharegpt_rejects_other_shapes() -> None:
    with pytest.raises(ValueError, match="JSON list"):
        sharegpt_pairs({"conversations": []}, seed=0)
    assert sharegpt_pairs([{"conversations": [{"from": "gpt", "value": "x"}]}], seed=0) == []


def test_custom_sample_output_tokens_per_line_or_fixed(llama3_tokenizer: Any) -> None:
    config = DatasetConfig(name="custom", path=CUSTOM)
    prompts = sample_prompts(llama3_tokenizer, config, 5, seed=0)
    lens = {p.text: p.output_len for p in prompts}
    assert lens["Translate 'good morning, neighbour' into French."] == 8
    assert lens[next(t for t in lens if t.startswith("Suggest a title"))] == 256  # no field
    assert all(p.input_len == count_tokens(llama3_tokenizer, p.text) for p in prompts)
    fixed = DatasetConfig(name="custom", path=CUSTOM, custom_output_len=11)
    assert {p.output_len for p in sample_prompts(llama3_tokenizer, fixed, 7, seed=0)} == {11}


def test_custom_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: each line must be"):
        custom_rows(str(path), seed=0)


def test_file_datasets_need_a_readable_path(llama3_tokenizer: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs --dataset-path"):
        sample_prompts(llama3_tokenizer, DatasetConfig(name="sharegpt"), 1, seed=0)
    missing = DatasetConfig(name="sharegpt", path=str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match="could not read"):
        sample_prompts(llama3_tokenizer, missing, 1, seed=0)


def test_repeat_asks_for_a_passage_of_words_back(byte_bpe_tokenizer: Any) -> None:
    config = DatasetConfig(name="repeat", repeat_passage_len=30)
    prompts = sample_prompts(byte_bpe_tokenizer, config, 5, seed=1)
    head = count_tokens(byte_bpe_tokenizer, REPEAT_INSTRUCTION)
    for p in prompts:
        assert p.text.startswith(REPEAT_INSTRUCTION) and p.text.endswith("\n")
        passage = p.text.removeprefix(REPEAT_INSTRUCTION).removesuffix("\n")
        assert count_tokens(byte_bpe_tokenizer, p.text[:-1]) == head + 30  # the passage's 30
        assert p.input_len == count_tokens(byte_bpe_tokenizer, p.text)
        assert all(word.isascii() and word.isalpha() for word in passage.split())
        assert p.output_len == 30  # the passage's length, unless set
    assert len({p.text for p in prompts}) == 5
    fixed = DatasetConfig(name="repeat", repeat_passage_len=8, repeat_output_len=50)
    assert {p.output_len for p in sample_prompts(byte_bpe_tokenizer, fixed, 3, 0)} == {50}
    assert fixed.describe() == "repeat 8→50 tok"


def test_repeat_passages_are_new_for_every_seed(llama3_tokenizer: Any) -> None:
    config = DatasetConfig(name="repeat", repeat_passage_len=12)
    one, two = (sample_prompts(llama3_tokenizer, config, 4, seed) for seed in (1, 2))
    assert one == sample_prompts(llama3_tokenizer, config, 4, 1)
    assert not {p.text for p in one} & {p.text for p in two}
    # no passage shares even its first words with another seed's (a prefix cache finds nothing)
    starts = [p.text.removeprefix(REPEAT_INSTRUCTION).split()[:2] for p in one + two]
    assert len({tuple(s) for s in starts}) == 8
    with pytest.raises(ValueError, match="repeat-passage-len"):
        sample_prompts(llama3_tokenizer, DatasetConfig(name="repeat", repeat_passage_len=0), 1, 0)


def test_words_are_whole_word_tokens_else_any_token() -> None:
    assert [is_word(p) for p in ("Ġcat", "▁Cat", "cat", "Ġc", "Ġ123", "Ġcafé", None)] == [
        True, True, False, False, False, False, False]
