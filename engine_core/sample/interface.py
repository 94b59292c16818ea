"""What a sampler is, to the engine: `TokenSampler`, one step's `SamplingBatch` in, a
`PendingSample` (its tokens, then its `SamplerOutput`) out.

Two implement it: `Sampler` (sampler.py, on the CPU LM head's fused scan) and `DeviceSampler`
(device_sampler.py, the whole step on the device, one host sync). Both give the same tokens for
the same batch and hidden states, up to float rounding at a draw's boundary: greedy is the
argmax of the processed logits, a draw is the inverse CDF of the truncated softmax at the
batch's uniform numbers, logprobs and ranks are the raw model's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np
import torch

from engine_core.sample.sampling_batch import SamplingBatch
from shared.step_outputs import Logprobs


class SamplerOutput(NamedTuple):
    token_ids: np.ndarray  # int64 [rows]
    logprob_rows: np.ndarray  # int64: the rows with logprobs (the batch's logprob_rows)
    logprobs: Logprobs | None  # a row each of logprob_rows


class PendingSample:
    """A step's sampling, queued: `tokens` on the device at once (an overlapped step's next
    inputs read them there), the whole `SamplerOutput` on the host when `result()` is asked
    (the one wait of the step)."""

    def __init__(self, tokens: torch.Tensor, result: Callable[[], SamplerOutput]) -> None:
        self.tokens = tokens
        self._result = result
        self._output: SamplerOutput | None = None

    @staticmethod
    def done(output: SamplerOutput, tokens: torch.Tensor | None = None) -> PendingSample:
        """A sampling already on the host (the CPU's, or one that had to wait)."""
        device_tokens = torch.from_numpy(output.token_ids) if tokens is None else tokens
        return PendingSample(device_tokens, lambda: output)

    def result(self) -> SamplerOutput:
        if self._output is None:
            self._output = self._result()
        return self._output


class TokenSampler(Protocol):
    """A step's tokens from the final hidden states of its logits rows."""

    @property
    def vocab(self) -> int:
        """The logits' width (what the batch builder bounds token ids by)."""
        ...

    def sample_later(self, hidden: torch.Tensor, batch: SamplingBatch) -> PendingSample:
        """Sample `batch` from `hidden` (a row per logits row of the batch), its results
        waited for when asked (the CPU's are there at once). A row's grammar matcher is
        advanced past its token before this returns."""
        ...

    def __call__(self, hidden: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """`sample_later(...).result()`."""
        ...
