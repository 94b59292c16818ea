"""The routing policy and the block index, pure: affinity, the balance margins, the cache
threshold, ties and round robin; the longest prefix over every engine at once."""

from __future__ import annotations

from frontend.engine.kv_index import BlockIndex
from frontend.engine.routing import Router, RoutingConfig

BOTH = [0, 1]


def test_the_longest_cached_prefix_wins_over_a_lighter_load() -> None:
    router = Router(RoutingConfig())
    choice = router.choose(BOTH, [10, 0], cached_blocks=16, holders=0b01, prompt_blocks=18)
    assert choice == (0, "prefix")


def test_an_engine_overloaded_by_both_margins_loses_its_affinity() -> None:
    router = Router(RoutingConfig(balance_abs_threshold=4, balance_rel_threshold=1.5))
    hold = {"cached_blocks": 16, "holders": 0b01, "prompt_blocks": 18}
    assert router.choose(BOTH, [5, 0], **hold) == (1, "balance")  # 5 > 0 + 4 and > 0 * 1.5
    assert router.choose(BOTH, [4, 0], **hold) == (0, "prefix")  # not past the absolute one
    assert router.choose(BOTH, [20, 14], **hold) == (0, "prefix")  # 20 < 14 * 1.5
    assert router.choose(BOTH, [22, 14], **hold) == (1, "balance")


def test_a_prefix_below_the_cache_threshold_counts_for_nothing() -> None:
    router = Router(RoutingConfig(cache_threshold=0.5))
    assert router.choose(BOTH, [3, 1], cached_blocks=1, holders=0b01, prompt_blocks=10) == (
        1, "load")
    assert router.choose(BOTH, [3, 1], cached_blocks=5, holders=0b01, prompt_blocks=10) == (
        0, "prefix")


def test_among_several_holders_the_least_loaded_takes_it() -> None:
    router = Router(RoutingConfig())
    assert router.choose([0, 1, 2], [0, 5, 2], 8, 0b110, 8) == (2, "prefix")


def test_equal_engines_take_turns_and_dead_ones_are_skipped() -> None:
    router = Router(RoutingConfig())
    picks = [router.choose([0, 1, 2], [0, 0, 0]) for _ in range(6)]
    assert [p.rank for p in picks if p] == [0, 1, 2, 0, 1, 2]
    assert [router.choose([0, 2], [0, 0, 0]).rank for _ in range(4)] == [0, 2, 0, 2]  # type: ignore[union-attr]
    assert router.choose([], [0, 0]) is None


def test_round_robin_ignores_caches_and_loads() -> None:
    router = Router(RoutingConfig(policy="round-robin"))
    picks = [router.choose(BOTH, [100, 0], 16, 0b01, 16) for _ in range(4)]
    assert [(p.rank, p.reason) for p in picks if p] == [(0, "round-robin"), (1, "round-robin")] * 2


def test_the_index_finds_each_engines_longest_prefix_in_one_walk() -> None:
    index = BlockIndex()
    index.store(0, [1, 2, 3])
    index.store(1, [1, 2])
    index.store(2, [9])
    assert index.longest_prefix([1, 2, 3, 4], 0b111) == (3, 0b001)
    assert index.longest_prefix([1, 2, 7], 0b111) == (2, 0b011)
    assert index.longest_prefix([1, 2, 3], 0b110) == (2, 0b010)  # engine 0 is not a candidate
    assert index.longest_prefix([5], 0b111) == (0, 0)
    index.remove(0, [2])
    assert index.longest_prefix([1, 2, 3], 0b111) == (2, 0b010)
    assert index.blocks[0] == 2 and index.blocks[1] == 2
    index.clear(1)
    assert index.longest_prefix([1, 2, 3], 0b111) == (1, 0b001)
    assert index.blocks[1] == 0 and index.longest_prefix([9], 0b100) == (1, 0b100)
