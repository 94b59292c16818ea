"""Builders for the sampler tests: a `SamplingBatch` from requests, as the engine builds it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_core.sample.batch_builder import build_sampling_batch
from engine_core.sample.sampling_batch import SamplingBatch
from engine_core.sched.request import Request
from shared.messages import SamplingParams


def batch_of(reqs: Sequence[Request], vocab: int, seed: int = 0,
             eos: Sequence[int] = ()) -> SamplingBatch:
    """The batch of `reqs` (a row each, in order) for logits `vocab` wide, the engine's
    generator seeded with `seed`."""
    return build_sampling_batch(reqs, vocab, list(eos), torch.Generator().manual_seed(seed))


def requests(params: Sequence[SamplingParams], prompt: Sequence[int] = (1,),
             outputs: Sequence[int] = ()) -> list[Request]:
    """A request per params, each with `prompt` and then `outputs` already generated."""
    reqs = [Request(f"r{i}", list(prompt), p) for i, p in enumerate(params)]
    for r in reqs:
        for t in outputs:
            r.append_token(t)
    return reqs
