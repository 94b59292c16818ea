"""Embeddings: a pooling request's prompt pooled into one vector, chunk by chunk.

A pooling request (`SamplingParams.pooling`, /v1/embeddings) is prompt-only: it is scheduled,
chunked and preempted like any prompt, and finishes when its prompt is computed. Each step
keeps the final hidden states (after the model's last norm, as Hugging Face's
`last_hidden_state`) of the positions its pooling reads (`pool_positions`): the last position
("last", vLLM's default for a decoder), the first ("cls"), or every one ("mean", summed in
float32 across chunks). The step that completes the prompt finishes the vector: the mean
divided by the prompt's length, cut to `dimensions` (a Matryoshka model's), then normalized
to unit length if asked. Preemption or abort drops a request's partial sum: its prompt is
computed, and pooled, again.

"mean" and "cls" read every position, so such prompts skip the prefix cache (as prompts that
ask for prompt logprobs do); "last" reads only the last position, which a prefix-cache hit
never covers (block_manager.lookup_prefix leaves at least one token to compute).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from shared.messages import Pooling, SamplingParams

KINDS = ("last", "mean", "cls")


class PoolChunk(NamedTuple):
    """A pooling request's positions kept this step: rows [lo, hi) of the step's kept hidden
    states."""

    request_id: str
    lo: int
    hi: int
    pooling: Pooling
    prompt_len: int
    completes: bool  # the step completes the prompt: its vector is whole


def pool_positions(kind: str, start: int, num_new: int, prompt_len: int) -> range:
    """The positions (relative to `start`) of a chunk [start, start + num_new) of a prompt
    of `prompt_len` tokens that pooling `kind` reads."""
    end = min(start + num_new, prompt_len)
    if kind == "mean":
        return range(0, max(0, end - start))
    at = 0 if kind == "cls" else prompt_len - 1
    return range(at - start, at - start + 1) if start <= at < end else range(0)


def pooling_error(p: SamplingParams, hidden_size: int,
                  matryoshka: Sequence[int] | None) -> str | None:
    """Why a pooling request cannot run, or None."""
    pooling = p.pooling
    if pooling is None:
        return None
    if pooling.kind not in KINDS:
        return f"pooling {pooling.kind!r}: one of {', '.join(KINDS)}"
    if p.max_tokens != 0 or p.prompt_logprobs is not None:
        return "an embedding request generates nothing (max_tokens 0, no prompt_logprobs)"
    dims = pooling.dimensions
    if dims:
        if matryoshka is None:
            return ("this model does not support Matryoshka representations: dimensions "
                    "cannot change its embeddings' width")
        if not 1 <= dims <= hidden_size or (matryoshka and dims not in matryoshka):
            allowed = (", ".join(map(str, matryoshka)) if matryoshka
                       else f"1 to {hidden_size}")
            return f"dimensions {dims}: this model allows {allowed}"
    return None


class Pooler:
    """The partial vectors of pooling prompts not yet complete, by request id."""

    def __init__(self) -> None:
        self._partial: dict[str, torch.Tensor] = {}

    def drop(self, request_id: str) -> None:
        """Forget a request's partial vector (preempted: pooled again; or aborted)."""
        self._partial.pop(request_id, None)

    def pool_step(self, chunks: Sequence[PoolChunk], hidden: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
        """Pool this step's kept rows (`chunks`, rows of `hidden`). Returns the vectors
        (float32, on the model's device) of the prompts this step completed, by request id."""
        done: dict[str, torch.Tensor] = {}
        for c in chunks:
            rid, pooling = c.request_id, c.pooling
            if c.hi > c.lo:
                rows = hidden[c.lo:c.hi].float()
                if pooling.kind == "mean":
                    part = rows.sum(0)
                    partial = self._partial.get(rid)
                    self._partial[rid] = part if partial is None else partial + part
                else:
                    self._partial[rid] = rows[0]
            if not c.completes:
                continue
            vector = self._partial.pop(rid)
            if pooling.kind == "mean":
                vector = vector / c.prompt_len
            if pooling.dimensions:
                vector = vector[:pooling.dimensions]
            if pooling.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            done[rid] = vector
        return done


def embedding_bytes(vector: torch.Tensor) -> bytes:
    """A vector as the wire's float32 little-endian bytes (`Finished.embedding`)."""
    return np.ascontiguousarray(vector.detach().cpu().numpy(), dtype="<f4").tobytes()
