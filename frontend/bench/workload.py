"""The workload: random prompts of an exact token length, and request arrival times.

Prompts are random token ids from the tokenizer's vocabulary (special and added tokens left
out), decoded to text, then re-encoded and adjusted until the text encodes to exactly
`input_len` tokens without special tokens. The server adds BOS (or a chat template) on top,
which is why the report also shows the server's own usage.prompt_tokens.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

# Trimming or extending a decoded prompt can re-merge tokens at the edit; a few rounds settle it.
ADJUST_ROUNDS = 16
FRESH_STARTS = 8


class Prompt(NamedTuple):
    text: str
    input_len: int  # tokens, encoded without special tokens


def load_tokenizer(name_or_path: str) -> Any:
    """The tokenizer of a folder or hub id, with a message the user can act on when it fails."""
    from frontend.text.tokenizer import load_tokenizer as load

    try:
        return load(name_or_path)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"could not load a tokenizer from {name_or_path!r} ({first_line(exc)}); "
            "pass --tokenizer with the model's folder or hub id"
        ) from None


def first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def candidate_ids(tokenizer: Any) -> np.ndarray:
    """Every token id of the tokenizer except special and added tokens."""
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    ids = np.arange(len(tokenizer), dtype=np.int64)
    return ids[~np.isin(ids, sorted(excluded))]


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def random_prompt(
    tokenizer: Any, input_len: int, rng: np.random.Generator, candidates: np.ndarray
) -> Prompt:
    """A text that encodes (without special tokens) to exactly `input_len` tokens."""
    for _ in range(FRESH_STARTS):
        ids = [int(i) for i in rng.choice(candidates, input_len)]
        for _ in range(ADJUST_ROUNDS):
            text = tokenizer.decode(ids)
            encoded = encode(tokenizer, text)
            if len(encoded) == input_len:
                return Prompt(text, input_len)
            if len(encoded) > input_len:
                ids = encoded[:input_len]
            else:
                ids = encoded + [int(i) for i in rng.choice(candidates, input_len - len(encoded))]
    raise ValueError(
        f"could not build a prompt of exactly {input_len} tokens with this tokenizer "
        f"after {FRESH_STARTS * ADJUST_ROUNDS} tries; try another --seed or --input-len"
    )


def build_prompts(tokenizer: Any, num_prompts: int, input_len: int, seed: int) -> list[Prompt]:
    """`num_prompts` distinct random prompts (no shared prefix to cache), reproducible by seed."""
    if input_len < 1:
        raise ValueError("--input-len must be at least 1")
    rng = np.random.default_rng([seed, 0])
    candidates = candidate_ids(tokenizer)
    return [random_prompt(tokenizer, input_len, rng, candidates) for _ in range(num_prompts)]


def arrival_times(count: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the start: the first at 0, then gamma-distributed gaps.

    The gaps have mean 1/request_rate and shape `burstiness` (1.0 is a Poisson process; lower
    is burstier, higher is more even). An infinite rate sends everything at once.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if math.isinf(request_rate) or count == 0:
        return [0.0] * count
    rng = np.random.default_rng([seed, 1])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
