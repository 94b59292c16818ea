"""The benchmark's datasets, with vLLM's names and meanings (`vllm bench serve --dataset-name`).

- random: input and output lengths drawn uniformly from the integers in
  [floor(L * (1 - r)), ceil(L * (1 + r))] (r = range ratio in [0, 1); an output length is at
  least 1), each prompt after one random prefix of `prefix_len` tokens shared by all of them.
- sharegpt: a local JSON file in ShareGPT's format, a list of {"conversations": [{"from":
  "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}; the first human turn is the
  prompt and the turn after it the answer, whose token count is the output length unless one is
  fixed. Entries are shuffled by seed; pairs with a prompt or answer under 4 tokens, a prompt
  over 1,024 or both over 2,048 are skipped, as vLLM skips them.
- custom: a JSONL file of {"prompt": ..., "output_tokens": ...} lines (output_tokens
  optional), shuffled by seed; a fixed output length overrides the lines'.
- prefix_repetition: `num_prefixes` random prefixes of `prefix_len` tokens, each followed by
  num_prompts // num_prefixes random suffixes of `suffix_len` tokens, shuffled (for prefix caches).
- repeat (Tandem's): "Repeat the following text exactly:\n<passage>\n", a passage of
  `repeat_passage_len` tokens of random whole words from the tokenizer's vocabulary, new for
  every seed (so every round: no round reads what a prefix cache kept of another); max_tokens
  the passage's length unless set. Output that repeats its prompt, the work n-gram speculation
  accepts most of (with a random-weight model only its own greedy loops repeat).

Files with fewer usable entries than requested are cycled. Token counts are without special
tokens, as the random prompts are built.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import cycle, islice
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from frontend.bench.workload import (
    Prompt,
    candidate_ids,
    count_tokens,
    random_text,
)

DATASETS = ("random", "sharegpt", "custom", "prefix_repetition", "repeat")
REPEAT_INSTRUCTION = "Repeat the following text exactly:\n"
MIN_WORDS = 1000  # fewer whole-word tokens than this: the passage draws from every token
# vLLM's pruning of ShareGPT pairs (its is_valid_sequence).
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
CUSTOM_DEFAULT_OUTPUT_LEN = 256  # vLLM's --custom-output-len default
HUMAN_ROLES = ("human", "user")


@dataclass(frozen=True)
class DatasetConfig:
    """What to send: the dataset and its options (vLLM's flags and defaults)."""

    name: str = "random"
    path: str | None = None  # sharegpt, custom
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None  # None: the answer's length
    custom_output_len: int | None = None  # None: each line's output_tokens, else 256
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    repeat_passage_len: int = 256
    repeat_output_len: int | None = None  # None: the passage's length

    def describe(self) -> str:
        """A short label for titles and tables, e.g. 'random 1024±0%→128 tok'."""
        if self.name == "random":
            spread = f"±{self.random_range_ratio:.0%}" if self.random_range_ratio else ""
            prefix = f"{self.random_prefix_len}+" if self.random_prefix_len else ""
            return f"random {prefix}{self.random_input_len}{spread}→{self.random_output_len} tok"
        if self.name == "prefix_repetition":
            return (
                f"prefix repetition {self.prefix_repetition_num_prefixes}×"
                f"({self.prefix_repetition_prefix_len}+{self.prefix_repetition_suffix_len})"
                f"→{self.prefix_repetition_output_len} tok"
            )
        if self.name == "repeat":
            output = self.repeat_output_len or self.repeat_passage_len
            return f"repeat {self.repeat_passage_len}→{output} tok"
        return f"{self.name} {Path(self.path or '?').name}"


def sample_prompts(
    tokenizer: Any, config: DatasetConfig, num_prompts: int, seed: int
) -> list[Prompt]:
    """`num_prompts` prompts (prefix_repetition: a multiple of its prefixes) from the dataset."""
    if config.name == "random":
        return random_prompts(tokenizer, config, num_prompts, seed)
    if config.name == "prefix_repetition":
        return prefix_repetition_prompts(tokenizer, config, num_prompts, seed)
    if config.name == "repeat":
        return repeat_prompts(tokenizer, config, num_prompts, seed)
    if config.path is None:
        raise ValueError(f"--dataset-name {config.name} needs --dataset-path FILE")
    if config.name == "sharegpt":
        pairs = sharegpt_pairs(read_json(config.path), seed)
        return sharegpt_prompts(tokenizer, pairs, num_prompts, config.sharegpt_output_len)
    if config.name == "custom":
        rows = custom_rows(config.path, seed)
        return custom_prompts(tokenizer, rows, num_prompts, config.custom_output_len)
    raise ValueError(f"unknown dataset {config.name!r}; use one of {', '.join(DATASETS)}")


class LengthRange(NamedTuple):
    low: int
    high: int  # inclusive


def length_range(length: int, range_ratio: float, minimum: int = 0) -> LengthRange:
    """vLLM's sampling interval: [floor(L(1 - r)), ceil(L(1 + r))], both at least `minimum`."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    low = math.floor(length * (1 - range_ratio))
    high = math.ceil(length * (1 + range_ratio))
    return LengthRange(max(low, minimum), max(high, minimum))


def random_prompts(
    tokenizer: Any, config: DatasetConfig, num_prompts: int, seed: int
) -> list[Prompt]:
    """Prompts of the shared random prefix + a random body of a sampled length."""
    inputs = length_range(config.random_input_len, config.random_range_ratio)
    outputs = length_range(config.random_output_len, config.random_range_ratio, minimum=1)
    if config.random_prefix_len + inputs.low < 1:
        raise ValueError(
            "every prompt needs a token: raise --random-input-len or --random-prefix-len, "
            "or lower --random-range-ratio"
        )
    rng = np.random.default_rng([seed, 0])
    candidates = candidate_ids(tokenizer)
    input_lens = rng.integers(inputs.low, inputs.high + 1, size=num_prompts)
    output_lens = rng.integers(outputs.low, outputs.high + 1, size=num_prompts)
    prefix = ""
    if config.random_prefix_len:
        prefix = random_text(tokenizer, config.random_prefix_len, rng, candidates)
    return [
        Prompt(
            random_text(tokenizer, int(n), rng, candidates, head=prefix),
            config.random_prefix_len + int(n),
            int(out),
        )
        for n, out in zip(input_lens, output_lens)
    ]


def prefix_repetition_prompts(
    tokenizer: Any, config: DatasetConfig, num_prompts: int, seed: int
) -> list[Prompt]:
    """num_prefixes × (num_prompts // num_prefixes) prompts, shuffled."""
    per_prefix = num_prompts // max(config.prefix_repetition_num_prefixes, 1)
    if config.prefix_repetition_num_prefixes < 1 or per_prefix == 0:
        raise ValueError(
            "--num-prompts must be at least --prefix-repetition-num-prefixes (at least 1)"
        )
    rng = np.random.default_rng([seed, 2])
    candidates = candidate_ids(tokenizer)
    length = config.prefix_repetition_prefix_len + config.prefix_repetition_suffix_len
    prompts = []
    for _ in range(config.prefix_repetition_num_prefixes):
        prefix = random_text(tokenizer, config.prefix_repetition_prefix_len, rng, candidates)
        for _ in range(per_prefix):
            text = random_text(
                tokenizer, config.prefix_repetition_suffix_len, rng, candidates, head=prefix
            )
            prompts.append(Prompt(text, length, config.prefix_repetition_output_len))
    random.Random(seed).shuffle(prompts)
    return prompts


def repeat_prompts(
    tokenizer: Any, config: DatasetConfig, num_prompts: int, seed: int
) -> list[Prompt]:
    """Prompts asking for a passage of random words back: the instruction and the passage
    encode to exactly count(instruction) + `repeat_passage_len` tokens (the passage's first word
    keeps its leading space); input_len counts the whole prompt, the final newline included."""
    if config.repeat_passage_len < 1:
        raise ValueError("--repeat-passage-len must be at least 1")
    rng = np.random.default_rng([seed, 3])
    words = word_ids(tokenizer)
    output_len = config.repeat_output_len or config.repeat_passage_len
    prompts = []
    for _ in range(num_prompts):
        text = random_text(tokenizer, config.repeat_passage_len, rng, words,
                           head=REPEAT_INSTRUCTION) + "\n"
        prompts.append(Prompt(text, count_tokens(tokenizer, text), output_len))
    return prompts


def word_ids(tokenizer: Any) -> np.ndarray:
    """The ids of tokens that are a whole word with its leading space (byte-level BPE's "Ġ",
    SentencePiece's "▁"), so that a passage reads as words; every candidate id when the
    vocabulary has few of them."""
    ids = candidate_ids(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens([int(i) for i in ids])
    words = ids[[is_word(piece) for piece in pieces]]
    return words if len(words) >= MIN_WORDS else ids


def is_word(piece: str | None) -> bool:
    word = (piece or "")[1:]
    return (piece or "")[:1] in ("Ġ", "▁") and len(word) >= 2 and word.isascii() and word.isalpha()


def read_json(path: str) -> Any:
    """A JSON file's content, with a message naming the file when it cannot be read."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not read {path} as JSON ({exc})") from None


class Pair(NamedTuple):
    prompt: str
    answer: str


def sharegpt_pairs(data: Any, seed: int) -> list[Pair]:
    """(first human turn, the turn after it) of every conversation that has both, shuffled."""
    if not isinstance(data, list):
        raise ValueError("a ShareGPT file is a JSON list of {\"conversations\": [...]} entries")
    pairs = [pair for entry in data if (pair := first_exchange(entry)) is not None]
    random.Random(seed).shuffle(pairs)
    return pairs


def first_exchange(entry: Any) -> Pair | None:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns[:-1]):
        if isinstance(turn, dict) and turn.get("from") in HUMAN_ROLES:
            answer = turns[i + 1]
            if isinstance(answer, dict) and isinstance(turn.get("value"), str):
                return Pair(turn["value"], str(answer.get("value", "")))
    return None


def sharegpt_prompts(
    tokenizer: Any, pairs: Sequence[Pair], num_prompts: int, output_len: int | None
) -> list[Prompt]:
    """The first `num_prompts` usable pairs as prompts (cycled when the file has fewer)."""
    usable = (prompt for pair in pairs if (prompt := sharegpt_prompt(tokenizer, pair, output_len)))
    return take_cycled(usable, num_prompts, "usable ShareGPT conversations")


def sharegpt_prompt(tokenizer: Any, pair: Pair, output_len: int | None) -> Prompt | None:
    """The pair as a Prompt, or None when vLLM's length rules would skip it."""
    prompt_len = count_tokens(tokenizer, pair.prompt)
    answer_len = count_tokens(tokenizer, pair.answer) if output_len is None else output_len
    too_short = prompt_len < MIN_LEN or (output_len is None and answer_len < MIN_LEN)
    too_long = prompt_len > MAX_PROMPT_LEN or prompt_len + answer_len > MAX_TOTAL_LEN
    return None if too_short or too_long else Prompt(pair.prompt, prompt_len, answer_len)


class Row(NamedTuple):
    prompt: str
    output_tokens: int | None


def custom_rows(path: str, seed: int) -> list[Row]:
    """The lines of a custom JSONL file, shuffled; a bad line is named by its number."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"could not read {path} ({exc})") from None
    rows = [custom_row(line, path, number) for number, line in enumerate(lines, 1) if line.strip()]
    random.Random(seed).shuffle(rows)
    return rows


def custom_row(line: str, path: str, number: int) -> Row:
    try:
        item = json.loads(line)
        prompt, output = item["prompt"], item.get("output_tokens")
        if not isinstance(prompt, str) or not (output is None or isinstance(output, int)):
            raise TypeError
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(
            f"{path}:{number}: each line must be "
            '{"prompt": "...", "output_tokens": N} (output_tokens optional)'
        ) from None
    return Row(prompt, output)


def custom_prompts(
    tokenizer: Any, rows: Sequence[Row], num_prompts: int, output_len: int | None
) -> list[Prompt]:
    """The rows as prompts; `output_len` (when given) overrides each line's output_tokens."""
    prompts = (
        Prompt(row.prompt, count_tokens(tokenizer, row.prompt), custom_output(row, output_len))
        for row in rows
    )
    return take_cycled(prompts, num_prompts, "lines")


def custom_output(row: Row, output_len: int | None) -> int:
    if output_len is not None:
        return output_len
    return row.output_tokens if row.output_tokens is not None else CUSTOM_DEFAULT_OUTPUT_LEN


def take_cycled(prompts: Iterable[Prompt], count: int, what: str) -> list[Prompt]:
    """The first `count` prompts, repeating them in order when there are fewer."""
    first = list(islice(prompts, count))
    if not first:
        raise ValueError(f"the dataset file has no {what}")
    repeated: Iterator[Prompt] = cycle(first)
    return list(islice(repeated, count))
