"""The step's `SamplingBatch` as the builder makes it from requests: columns, edits, uniform
numbers, logprob and grammar rows, and the rows' logits rows with draft tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_core.sample.sampling_batch import Drafts
from shared.messages import SamplingParams
from tests.unit.engine_core.sample.batches import batch_of, requests
from tests.unit.engine_core.sample.test_sampler import constrained, thinking

VOCAB = 100


def test_columns_read_the_draw_settings_of_the_rows_that_draw_only():
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1),  # greedy: off
              SamplingParams(temperature=0.7, top_k=5, top_p=0.5, min_p=0.1),
              SamplingParams(temperature=1.0, top_k=VOCAB),  # k >= vocabulary: off
              SamplingParams(temperature=1e-6)]  # below GREEDY_EPS: greedy
    batch = batch_of(requests(params), VOCAB)
    assert batch.num_rows == 4 and batch.sampled.tolist() == [1, 2]
    assert batch.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0, 1e-6])
    assert batch.top_k.tolist() == [0, 5, 0, 0]
    assert batch.top_p.tolist() == pytest.approx([1.0, 0.5, 1.0, 1.0])
    assert batch.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0, 0.0])
    assert batch.uniform[[0, 3]].tolist() == [0.0, 0.0] and (batch.uniform[[1, 2]] > 0).all()
    assert not batch.processed and not batch.reads_outputs and batch.top_logprobs == 0


def test_edits_are_the_rows_bias_ban_and_penalties_counted_from_their_tokens():
    reqs = requests([SamplingParams(logit_bias={3: 1.5, VOCAB: 2.0}),
                     SamplingParams(min_tokens=4, stop_token_ids=[7]),
                     SamplingParams(min_tokens=4, ignore_eos=True),
                     SamplingParams(repetition_penalty=1.2),
                     SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)],
                    prompt=[4, 4, 9], outputs=[9, 2, 9])
    batch = batch_of(reqs, VOCAB, eos=[99])
    assert list(zip(batch.bias.rows, batch.bias.ids, batch.bias.values)) == [(0, 3, 1.5)]
    assert [(r, i) for r, i in zip(batch.banned.rows, batch.banned.ids)] == [(1, 7), (1, 99)]
    assert batch.repetition.rows.tolist() == [3] * 3 and batch.repetition.ids.tolist() == [2, 4, 9]
    assert batch.penalty.ids.tolist() == [2, 9]
    assert batch.penalty.values.tolist() == [0.75, 1.25]  # 0.5 * count + 0.25
    assert batch.edited_rows.tolist() == [0, 1, 3, 4]
    assert batch.processed and batch.reads_outputs


def test_min_tokens_ban_ends_with_the_outputs():
    done = requests([SamplingParams(min_tokens=2, stop_token_ids=[7])], outputs=[1, 2])
    assert not batch_of(done, VOCAB).banned


def test_seeded_rows_draw_their_own_numbers_and_more_uniforms_continue_them():
    params = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.0)]
    batch = batch_of(requests(params), VOCAB, seed=1)
    own = torch.Generator().manual_seed(3)
    assert batch.uniform[0] == torch.rand(1, generator=own).item()
    assert batch.uniform[1] == torch.rand(2, generator=torch.Generator().manual_seed(1))[1]
    assert batch.more_uniforms([0])[0] == torch.rand(1, generator=own).item()
    assert list(batch.seeded) == [0]


def test_logprob_rows_and_grammar_rows():
    reqs = requests([SamplingParams(logprobs=3), SamplingParams(), SamplingParams(logprobs=0)])
    reqs += constrained(1, "f+", temperature=0.0) + thinking(1, "f+", temperature=0.0)
    batch = batch_of(reqs, 600)
    assert batch.logprob_rows.tolist() == [0, 2] and batch.logprob_k.tolist() == [3, 0]
    assert batch.top_logprobs == 3
    assert batch.constrained == [3] and list(batch.grammars) == [3]  # not the thinking row
    assert batch.reads_outputs  # a grammar's next step reads this one's token


def test_an_empty_step_builds_an_empty_batch():
    batch = batch_of([], VOCAB)
    assert batch.num_rows == 0 and not len(batch.sampled)


def test_draft_tokens_give_each_request_k_plus_one_rows():
    """A request verifying k drafts has k + 1 consecutive rows from its group start (their
    edits: tests/unit/engine_core/sample/test_speculative.py)."""
    from engine_core.sample.batch_builder import build_sampling_batch

    reqs = requests([SamplingParams()] * 3)
    drafts = Drafts(np.array([0, 2, 1]), np.array([11, 12, 13]))
    batch = build_sampling_batch(reqs, VOCAB, [], torch.Generator(), drafts)
    assert batch.group_starts.tolist() == [0, 1, 4] and batch.num_rows == 6
    batch.check(torch.zeros(6, 4))
    plain = batch_of(reqs, VOCAB)
    assert plain.group_starts.tolist() == [0, 1, 2]
    plain.check(torch.zeros(3, 4))
    with pytest.raises(ValueError):
        plain.check(torch.zeros(4, 4))
