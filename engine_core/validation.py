"""The engine's boundary checks: nothing a frontend sends is trusted.

A frontend checks every OpenAI request before it becomes an `AddRequest`, but the engine's
socket is reachable by anything that speaks msgpack (a frontend of another version, a bug, a
stranger on a tcp:// port). A value the sampler cannot handle (a NaN temperature, a stop token
id of -1e9, a prompt buffer that is not whole int32s) would raise inside `step()` and take
every running request with it. So each wire request is checked here with the frontend's own
limits (frontend/openai/protocol/base.py, serving/plan.py), and a bad one is refused with an
error row.

Pure functions: `prompt_ids` reads the prompt buffer, `params_error` checks the sampling values;
each returns the message a user can act on, or None.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from shared.messages import MAX_LOGPROBS, SamplingParams, read_ints

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGIT_BIAS = 100.0  # the frontend clamps to [-100, 100], as OpenAI does


def prompt_ids(buf: bytes | list[int], vocab_size: int) -> tuple[list[int], str | None]:
    """The prompt's token ids from its int32 wire buffer (or a list, in-process), with the
    reason it is unusable, if it is."""
    if isinstance(buf, (bytes, bytearray, memoryview)):
        if len(buf) % 4:
            return [], (f"the prompt token buffer has {len(buf)} bytes, not a whole number of "
                        "int32 token ids")
        ids = read_ints(bytes(buf))
    else:
        ids = list(buf)
    if not ids:
        return ids, "the prompt is empty"
    if not _ids_in_range(ids, vocab_size):
        return ids, f"prompt token ids must be in [0, {vocab_size})"
    return ids, None


def params_error(p: SamplingParams, vocab_size: int,
                 max_logprobs: int = MAX_LOGPROBS) -> str | None:
    """Why these sampling parameters cannot run, or None: the frontend's limits, again."""
    error = _logprobs_error(p, max_logprobs)
    for check in (_counts_error, _sampling_error, _penalty_error):
        error = error or check(p)
    return error or _token_ids_error(p, vocab_size)


def _logprobs_error(p: SamplingParams, max_logprobs: int) -> str | None:
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if k is not None and not 0 <= k <= max_logprobs:
            return f"{name} must be between 0 and {max_logprobs} (--max-logprobs)"
    return None


def _counts_error(p: SamplingParams) -> str | None:
    if p.max_tokens < 0:
        return "max_tokens must be at least 0"
    if p.min_tokens < 0:
        return "min_tokens must be at least 0"
    if p.seed is not None and not INT64_MIN <= p.seed <= INT64_MAX:
        return "seed must fit in a signed 64-bit integer"
    return None


def _sampling_error(p: SamplingParams) -> str | None:
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        return "temperature must be a finite number >= 0"
    if not (math.isfinite(p.top_p) and 0 < p.top_p <= 1):
        return "top_p must be in (0, 1]"
    if not -1 <= p.top_k <= INT64_MAX:
        return "top_k must be -1, 0 (off) or a positive count"
    if not (math.isfinite(p.min_p) and 0 <= p.min_p <= 1):
        return "min_p must be in [0, 1]"
    return None


def _penalty_error(p: SamplingParams) -> str | None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not (math.isfinite(value) and -2 <= value <= 2):
            return f"{name} must be in [-2, 2]"
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        return "repetition_penalty must be a finite number > 0"
    return None


def _token_ids_error(p: SamplingParams, vocab_size: int) -> str | None:
    if not _ids_in_range(p.stop_token_ids, vocab_size):
        return f"stop_token_ids must be in [0, {vocab_size})"
    if not _ids_in_range(p.reasoning_end, vocab_size):
        return f"reasoning_end token ids must be in [0, {vocab_size})"
    if p.logit_bias:
        if not _ids_in_range(p.logit_bias, vocab_size):
            return f"logit_bias keys must be token ids in [0, {vocab_size})"
        if not all(math.isfinite(v) and abs(v) <= MAX_LOGIT_BIAS
                   for v in p.logit_bias.values()):
            return (f"logit_bias values must be finite, in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}]")
    return None


def _ids_in_range(ids: Iterable[int], vocab_size: int) -> bool:
    ids = list(ids)  # min/max run in C: a long prompt is checked in milliseconds
    return not ids or (min(ids) >= 0 and max(ids) < vocab_size)
