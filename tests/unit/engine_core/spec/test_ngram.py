"""The n-gram proposer on token lists: the longest match first, its latest earlier
occurrence, at most k (and the limit), nothing without a match."""

from __future__ import annotations

from engine_core.spec.ngram import NgramProposer
from shared.speculative import SpeculativeConfigError, parse_speculative_config


def test_the_continuation_of_the_latest_occurrence_of_the_longest_match():
    p = NgramProposer(k=4, min_n=2, max_n=3)
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], 10) == [4, 5, 1, 2]
    # [2, 3] matches twice; the latest earlier occurrence wins
    assert p.propose([2, 3, 7, 2, 3, 8, 9, 2, 3], 10) == [8, 9, 2, 3]
    # a 3-gram match beats a later 2-gram one
    assert p.propose([5, 2, 3, 4, 9, 2, 3, 6, 5, 2, 3], 10) == [4, 9, 2, 3]


def test_at_most_k_and_the_limit_and_nothing_without_a_match():
    p = NgramProposer(k=4, min_n=2, max_n=3)
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], 2) == [4, 5]
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], 0) == []
    assert p.propose([1, 2, 3, 4, 5, 6], 10) == []
    assert p.propose([7], 10) == []
    # a run of one token: the continuation of the longest match, as far as it goes
    assert p.propose([9, 7, 7, 7, 7], 10) == [7]


def test_vllms_config_keys_and_defaults():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert config.kind == "ngram" and config.ngram_sizes == (5, 5)
    one = parse_speculative_config('{"num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert one.kind == "ngram" and one.ngram_sizes == (4, 4)
    draft = parse_speculative_config('{"model": "/m", "num_speculative_tokens": 2}')
    assert draft.kind == "draft_model"
    for bad, words in (('{"num_speculative_tokens": 0}', "at least 1"),
                       ('{"num_speculative_tokens": 2, "method": "eagle"}', "eagle"),
                       ('{"num_speculative_tokens": 2, "prompt_lookup_min": 5, '
                        '"prompt_lookup_max": 3}', "at most"),
                       ('{"num_speculative_tokens": 2, "bogus": 1}', "bogus"),
                       ('{"method": "draft_model", "num_speculative_tokens": 2}', "model")):
        try:
            parse_speculative_config(bad)
        except SpeculativeConfigError as exc:
            assert words in str(exc), (bad, exc)
        else:
            raise AssertionError(bad)
