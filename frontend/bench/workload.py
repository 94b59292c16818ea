"""The workload's building blocks: prompts of an exact token length, and request arrival times.

A prompt of N tokens is random token ids from the tokenizer's vocabulary (special and added
tokens left out), decoded to text, re-encoded and adjusted until the text encodes to exactly N
tokens without special tokens. The server adds BOS (or a chat template) on top, which is why
the report also shows the server's own usage.prompt_tokens. The datasets (datasets.py) build
on these; arrival times follow a rate (optionally ramping up) with gamma-distributed gaps.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

# Trimming or extending a decoded prompt can re-merge tokens at the edit; a few rounds settle it.
ADJUST_ROUNDS = 16
FRESH_STARTS = 8


class Prompt(NamedTuple):
    """One request of the workload: its text, its token count, and the max_tokens it asks."""

    text: str
    input_len: int  # tokens, encoded without special tokens
    output_len: int  # max_tokens


class RampUp(NamedTuple):
    """A request rate that grows from `start_rps` to `end_rps` over the run."""

    strategy: str  # "linear" | "exponential"
    start_rps: float
    end_rps: float


def load_tokenizer(name_or_path: str) -> Any:
    """The tokenizer of a folder or hub id, with a message the user can act on when it fails."""
    from frontend.text.tokenizer_loader import load_tokenizer as load

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


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(encode(tokenizer, text))


def random_text(
    tokenizer: Any,
    length: int,
    rng: np.random.Generator,
    candidates: np.ndarray,
    head: str = "",
) -> str:
    """`head` + random text, the whole encoding (no special tokens) to exactly
    count(head) + `length` tokens; `head` is kept verbatim (a shared prefix stays shared)."""
    target = count_tokens(tokenizer, head) + length if head else length
    for _ in range(FRESH_STARTS):
        ids = draw(rng, candidates, length)
        for _ in range(ADJUST_ROUNDS):
            text = head + tokenizer.decode(ids)
            encoded = encode(tokenizer, text)
            excess = len(encoded) - target
            if excess == 0:
                return text
            if not head:  # the re-encoded ids are stable under decode: trim them instead
                ids = encoded
            ids = ids[: len(ids) - excess] if excess > 0 else ids + draw(rng, candidates, -excess)
    raise ValueError(
        f"could not build a prompt of exactly {target} tokens with this tokenizer "
        f"after {FRESH_STARTS * ADJUST_ROUNDS} tries; try another --seed or input length"
    )


def draw(rng: np.random.Generator, candidates: np.ndarray, count: int) -> list[int]:
    return [int(i) for i in rng.choice(candidates, count)]


def build_prompts(
    tokenizer: Any, num_prompts: int, input_len: int, seed: int, output_len: int = 1
) -> list[Prompt]:
    """`num_prompts` distinct random prompts of exactly `input_len` tokens, reproducible by seed."""
    if input_len < 1:
        raise ValueError("--random-input-len must be at least 1")
    rng = np.random.default_rng([seed, 0])
    candidates = candidate_ids(tokenizer)
    return [
        Prompt(random_text(tokenizer, input_len, rng, candidates), input_len, output_len)
        for _ in range(num_prompts)
    ]


def arrival_times(
    count: int,
    request_rate: float,
    burstiness: float,
    seed: int,
    ramp_up: RampUp | None = None,
) -> list[float]:
    """Send times in seconds from the start: the first at 0, then gamma-distributed gaps.

    The gap before request i has mean 1/rate_i and shape `burstiness` (1.0 is a Poisson
    process; lower is burstier, higher is more even). rate_i is `request_rate`, or with a
    ramp-up the rate at i's share of the run, as vLLM defines it: linear
    start + (end - start) * p, exponential start * (end / start) ** p, p = i / (count - 1).
    An infinite rate (and no ramp-up) sends everything at once.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if count == 0 or (ramp_up is None and math.isinf(request_rate)):
        return [0.0] * count
    rates = np.asarray([rate_at(i, count, request_rate, ramp_up) for i in range(1, count)])
    rng = np.random.default_rng([seed, 1])
    gaps = rng.gamma(shape=burstiness, size=count - 1) / (rates * burstiness)
    return [0.0, *np.cumsum(gaps).tolist()]


def rate_at(index: int, count: int, request_rate: float, ramp_up: RampUp | None) -> float:
    """The request rate (requests/s) in force for request `index` of `count`."""
    if ramp_up is None:
        return request_rate
    progress = index / max(count - 1, 1)
    if ramp_up.strategy == "linear":
        return ramp_up.start_rps + (ramp_up.end_rps - ramp_up.start_rps) * progress
    if ramp_up.strategy == "exponential":
        return float(ramp_up.start_rps * (ramp_up.end_rps / ramp_up.start_rps) ** progress)
    raise ValueError(f"unknown ramp-up strategy {ramp_up.strategy!r}; use linear or exponential")


def check_ramp_up(ramp_up: RampUp, request_rate: float) -> None:
    """ValueError with the fix when a ramp-up cannot run (vLLM's rules)."""
    if not math.isinf(request_rate):
        raise ValueError("--ramp-up-strategy sets the rate itself; drop --request-rate")
    if ramp_up.strategy not in ("linear", "exponential"):
        raise ValueError("--ramp-up-strategy must be linear or exponential")
    if ramp_up.start_rps < 0 or ramp_up.end_rps <= 0 or ramp_up.start_rps > ramp_up.end_rps:
        raise ValueError("--ramp-up-start-rps must be >= 0 and <= --ramp-up-end-rps (> 0)")
    if ramp_up.strategy == "exponential" and ramp_up.start_rps == 0:
        raise ValueError("an exponential ramp-up needs --ramp-up-start-rps above 0")
