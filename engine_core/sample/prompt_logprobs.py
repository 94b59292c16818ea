"""Prompt logprobs, scored chunk by chunk as a prompt is computed and sent once it is whole.

A prompt that asked for logprobs may be computed over several steps (chunked prefill, the
scheduler's budget of prompt rows); each step scores the positions it computed, and the chunks
wait here, keyed by request, until the last one. Preemption or abort drops a request's chunks:
after a preemption its prompt is computed, and scored, again from the start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine_core.layers.lm_head import LMHead
from engine_core.sample.sampler import token_logprobs
from shared.step_outputs import Logprobs

# Prompt positions per LM-head scan, so a long echoed prompt never materialises a
# [prompt_len, vocab] logits tensor at once (how 64 was chosen: docs/benchmarks.md).
PROMPT_LOGITS_ROWS = 64


class PromptChunk(NamedTuple):
    """A request's prompt positions computed this step: the step's hidden rows [lo, hi) score
    `targets`, the prompt tokens that follow those positions (a row each)."""

    request_id: str
    lo: int
    hi: int
    targets: Sequence[int]
    k: int  # top entries asked for
    completes: bool  # the step completes the prompt: its logprobs are whole


class PromptLogprobsAccumulator:
    """The scored chunks of prompts not yet complete, by request id, in order."""

    def __init__(self) -> None:
        self._chunks: dict[str, list[Logprobs]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._chunks

    def add(self, request_id: str, chunk: Logprobs) -> None:
        self._chunks.setdefault(request_id, []).append(chunk)

    def complete(self, request_id: str, k: int) -> Logprobs:
        """The request's chunks as one, in order (`k` top entries each); forgets them."""
        return Logprobs.concat(self._chunks.pop(request_id, []), k)

    def drop(self, request_id: str) -> None:
        """Forget a request's partial chunks (preempted: it is scored again; or aborted)."""
        self._chunks.pop(request_id, None)

    def score_step(self, head: LMHead, chunks: Sequence[PromptChunk], hidden: torch.Tensor
                   ) -> dict[str, Logprobs]:
        """Score this step's prompt positions (`chunks`, rows of `hidden`). Returns the prompts
        completed by this step, by request id."""
        done: dict[str, Logprobs] = {}
        for c in chunks:
            for a in range(c.lo, c.hi, PROMPT_LOGITS_ROWS):
                b = min(c.hi, a + PROMPT_LOGITS_ROWS)
                targets = torch.tensor(c.targets[a - c.lo:b - c.lo])
                self.add(c.request_id, token_logprobs(head, hidden[a:b], targets, c.k))
            if c.completes:
                done[c.request_id] = self.complete(c.request_id, c.k)
        return done
