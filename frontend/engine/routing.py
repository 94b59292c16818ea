"""Which engine gets a request: the routing policy, a pure function of what the frontend knows.

Cache-aware (the default), as SGLang's gateway decides: the request goes to the engine holding
the longest cached prefix of its prompt, when that prefix is at least `cache_threshold` of the
prompt, unless that engine is overloaded against the least-loaded one by both margins (more
than `balance_abs_threshold` requests more and more than `balance_rel_threshold` times as
many); then, and when no engine holds enough of the prompt, the least-loaded engine takes it.
Ties go round the engines, so equal engines share the work. `round-robin` ignores caches and
loads (kept for comparison). The caller supplies the figures: each engine's load and the
longest prefix (`frontend/engine/kv_index.py`); choosing is a few comparisons per engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

POLICIES = ("cache-aware", "round-robin")


@dataclass(frozen=True)
class RoutingConfig:
    """`--data-parallel-routing` and SGLang's thresholds (its names and defaults)."""

    policy: str = "cache-aware"
    cache_threshold: float = 0.3  # least share of the prompt cached for affinity to count
    balance_abs_threshold: float = 64  # requests more than the least-loaded engine ...
    balance_rel_threshold: float = 1.5  # ... and this many times as many: overloaded


class Choice(NamedTuple):
    rank: int
    reason: str  # "prefix", "load", "balance" (affinity overruled), "round-robin", "pinned"


class Router:
    """Chooses among engines 0..n-1; keeps only the position of its round."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._turn = 0

    def choose(self, alive: Sequence[int], loads: Sequence[float], cached_blocks: int = 0,
               holders: int = 0, prompt_blocks: int = 0) -> Choice | None:
        """`alive`: the engines that may take work (None when there is none); `loads[r]`:
        engine r's load; `holders`: a bitmask of the engines holding the longest cached prefix,
        `cached_blocks` blocks of the prompt's `prompt_blocks` full blocks."""
        if not alive:
            return None
        if self.config.policy == "round-robin":
            return Choice(self._next(alive), "round-robin")
        least = self._least_loaded(alive, loads)
        if holders and cached_blocks and cached_blocks >= self.config.cache_threshold * max(
                prompt_blocks, 1):
            best = self._least_loaded([r for r in alive if holders >> r & 1], loads)
            if self.overloaded(loads[best], loads[least]):
                return Choice(least, "balance")
            return Choice(best, "prefix")
        return Choice(least, "load")

    def overloaded(self, load: float, least: float) -> bool:
        return (load - least > self.config.balance_abs_threshold
                and load > least * self.config.balance_rel_threshold)

    def _least_loaded(self, ranks: Sequence[int], loads: Sequence[float]) -> int:
        """The least-loaded of `ranks`; among equals, the first at or after the round's turn."""
        if len(ranks) == 1:
            return ranks[0]
        low = min(loads[r] for r in ranks)
        tied = [r for r in ranks if loads[r] == low]
        return self._next(tied)

    def _next(self, ranks: Sequence[int]) -> int:
        pick = next((r for r in ranks if r >= self._turn), ranks[0])
        self._turn = pick + 1
        return pick


def add_routing_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data-parallel routing (SGLang's thresholds)")
    group.add_argument("--data-parallel-routing", default="cache-aware", choices=POLICIES,
                       help="how a frontend picks an engine: the longest cached prefix unless "
                            "that engine is overloaded (cache-aware), or in turn (round-robin)")
    group.add_argument("--cache-threshold", type=float, default=0.3,
                       help="least share of a prompt an engine must hold cached to be preferred")
    group.add_argument("--balance-abs-threshold", type=float, default=64,
                       help="an engine this many requests above the least-loaded one ...")
    group.add_argument("--balance-rel-threshold", type=float, default=1.5,
                       help="... and this many times its load is overloaded: the request goes "
                            "to the least-loaded engine instead")


def routing_config(args: argparse.Namespace) -> RoutingConfig:
    return RoutingConfig(args.data_parallel_routing, args.cache_threshold,
                         args.balance_abs_threshold, args.balance_rel_threshold)


def routing_argv(args: argparse.Namespace) -> list[str]:
    return ["--data-parallel-routing", args.data_parallel_routing,
            "--cache-threshold", str(args.cache_threshold),
            "--balance-abs-threshold", str(args.balance_abs_threshold),
            "--balance-rel-threshold", str(args.balance_rel_threshold)]
