"""Verification on the one sampling path: rows expanded per draft (penalties and min_tokens
see the drafts before a row), acceptance, and seeded generators rewound to one draw per
emitted token."""

from __future__ import annotations

import numpy as np
import torch

from engine_core.sample.batch_builder import RequestSampling, build_sampling_batch
from engine_core.sample.sampling_batch import Drafts
from engine_core.sample.speculative import accept, rewind
from shared.messages import SamplingParams


class Row:
    def __init__(self, params: SamplingParams, outputs: list[int]) -> None:
        self.sampling = RequestSampling(params)
        self.output_token_ids = outputs
        self.all_token_ids = [1, 2] + outputs
        self.grammar = None
        self.masked = False


def test_acceptance_keeps_rows_while_the_sample_is_the_draft():
    drafts = Drafts(np.array([0, 2, 3, 1]), np.array([5, 6, 7, 8, 9, 3]))
    tokens = np.array([1, 5, 6, 4, 7, 0, 9, 2, 3, 11])  # rows: [0], [1-3], [4-7], [8-9]
    got = accept(tokens, drafts)
    assert got.counts.tolist() == [1, 3, 2, 2] and got.accepted.tolist() == [0, 2, 1, 1]
    assert got.rows.tolist() == [0, 1, 2, 3, 4, 5, 8, 9]
    plain = accept(np.array([4, 5]), Drafts.none(2))
    assert plain.counts.tolist() == [1, 1] and plain.rows.tolist() == [0, 1]


def test_each_row_sees_the_drafts_before_it():
    params = SamplingParams(max_tokens=9, frequency_penalty=1.0, min_tokens=3,
                            stop_token_ids=[50])
    rows = [Row(params, [7]), Row(SamplingParams(max_tokens=9), [])]
    batch = build_sampling_batch(rows, 100, [99], torch.Generator(),
                                 Drafts(np.array([2, 0]), np.array([7, 8])))
    assert batch.num_rows == 4 and batch.group_starts.tolist() == [0, 3]
    penalty = batch.penalty
    seen = {r: dict(zip(penalty.ids[penalty.rows == r].tolist(),
                        penalty.values[penalty.rows == r].tolist())) for r in range(3)}
    assert seen == {0: {7: 1.0}, 1: {7: 2.0}, 2: {7: 2.0, 8: 1.0}}  # counted token by token
    banned = sorted(set(batch.banned.rows.tolist()))
    assert banned == [0, 1]  # min_tokens 3: outputs 1 and 2 ban the stops, 3 does not


def test_a_seeded_generator_ends_as_after_one_draw_per_emitted_token():
    params = SamplingParams(max_tokens=9, temperature=1.0, seed=5)
    row = Row(params, [])
    generator = row.sampling.generator
    assert generator is not None
    want = torch.Generator().manual_seed(5)
    batch = build_sampling_batch([row], 100, [], torch.Generator(),
                                 Drafts(np.array([3]), np.array([1, 2, 3])))
    # its four rows drew the generator's next four numbers, in order
    assert batch.uniform.tolist() == [torch.rand(1, generator=want).item() for _ in range(4)]
    rewind(batch.seeded_states, np.array([2]))  # two tokens emitted: two draws, no more
    again = torch.Generator().manual_seed(5)
    torch.rand(1, generator=again), torch.rand(1, generator=again)
    assert torch.rand(1, generator=generator).item() == torch.rand(1, generator=again).item()


def test_acceptance_stops_at_a_requests_limit():
    """A grammar's limit (batch_builder.expand): no draft at or past it is accepted, even one
    its row sampled."""
    drafts = Drafts(np.array([3, 2]), np.array([5, 6, 7, 8, 9]), np.array([1, 2]))
    tokens = np.array([5, 6, 7, 0, 8, 9, 4])
    got = accept(tokens, drafts)
    assert got.accepted.tolist() == [1, 2] and got.counts.tolist() == [2, 3]
    assert got.rows.tolist() == [0, 1, 4, 5, 6]
