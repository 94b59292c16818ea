"""EngineGroup against two fake engines with real sockets: prefix affinity learned from their
KV-cache events (replay included), the balance margin, pinning, n choices together, several
frontends deciding from the engines' published loads, aborts to the right engine, and an engine
that dies leaving routing at once (its requests failing clearly) and rejoining empty."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from frontend.engine.client import EngineClient, EngineDeadError
from frontend.engine.group import PINNED_RANK, EngineGroup
from frontend.engine.routing import RoutingConfig
from frontend.engine.stream import OutputStream
from shared.messages import SamplingParams
from tests.unit.fake_engine import BOS, FakeEngine

FAST = SamplingParams(max_tokens=2)
LONG = SamplingParams(max_tokens=200, ignore_eos=True)


def prompt(family: int, suffix: int = 0, blocks: int = 4) -> list[int]:
    """`blocks` full blocks of a family's shared prefix, then a suffix of its own."""
    return ([BOS] + [1000 + 37 * family + k for k in range(16 * blocks - 1)]
            + [50_000 + 11 * suffix + k for k in range(5)])


def make_client(address: str) -> EngineClient:
    # a silent fake engine's process is up (its socket answers ZeroMQ's heartbeats): it counts
    # as dead after the stall bound, not after silence_timeout
    return EngineClient(address, heartbeat_interval=0.05, silence_timeout=0.3,
                        stall_timeout=1.0)


@pytest.fixture
def engines() -> list[FakeEngine]:
    fakes = [FakeEngine(rank=r, kv_events=True, step_delay=0.01).start() for r in range(2)]
    yield fakes
    for fake in fakes:
        if not fake._stopping.is_set():
            fake.stop()


async def started(engines: list[FakeEngine], **routing: float | str) -> EngineGroup:
    group = EngineGroup([e.address for e in engines], make_client, RoutingConfig(**routing))
    await group.start()
    return group


@pytest.fixture
async def group(engines: list[FakeEngine]) -> AsyncIterator[EngineGroup]:
    g = await started(engines)
    yield g
    await g.close()


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def served_by(engines: list[FakeEngine], request_id: str) -> int:
    """The rank of the engine that received the request (once one has)."""

    def holders() -> list[int]:
        return [r for r, e in enumerate(engines) if any(a.request_id == request_id
                                                          for a in e.added)]

    await until(lambda: bool(holders()))
    (rank,) = holders()
    return rank


async def test_requests_follow_the_engine_that_caches_their_prefix(
        group: EngineGroup, engines: list[FakeEngine]) -> None:
    for family in range(4):  # four prefixes, spread by load at first
        group.add(f"first-{family}", prompt(family), FAST)
    firsts = [await served_by(engines, f"first-{f}") for f in range(4)]
    assert sorted(firsts) == [0, 0, 1, 1]
    await until(lambda: group.index.blocks[0] >= 8 and group.index.blocks[1] >= 8)
    for i in range(12):
        family = i % 4
        group.add(f"again-{i}", prompt(family, suffix=i), FAST)
        assert await served_by(engines, f"again-{i}") == firsts[family]


async def test_a_later_frontend_learns_earlier_blocks_by_replay(
        group: EngineGroup, engines: list[FakeEngine]) -> None:
    group.add("early", prompt(7), FAST)
    holder = await served_by(engines, "early")
    late = await started(engines)
    try:
        await until(lambda: late.index.blocks[holder] >= 4)
        late.add("late", prompt(7, suffix=1), FAST)
        assert await served_by(engines, "late") == holder
    finally:
        await late.close()


async def test_an_overloaded_holder_loses_the_request_to_the_least_loaded(
        engines: list[FakeEngine]) -> None:
    group = await started(engines, balance_abs_threshold=4, balance_rel_threshold=1.5)
    try:
        PINNED_RANK.set(0)
        group.add("seed", prompt(3), FAST)
        group.add("seed-2", prompt(4), FAST)
        PINNED_RANK.set(None)
        await until(lambda: group.index.blocks[0] >= 8)
        engines[0].load = 5  # its pings now report five queued
        await until(lambda: all(c.load is not None and c.load.running == (5 if r == 0 else 0)
                                for r, c in group.clients))
        group.add("balanced", prompt(3, suffix=1), FAST)
        assert await served_by(engines, "balanced") == 1
        engines[0].load = 4  # within the absolute margin: the cache wins again
        await until(lambda: group.clients[0][1].load.running == 4)  # type: ignore[union-attr]
        group.add("affine", prompt(4, suffix=2), FAST)  # only engine 0 holds this family
        assert await served_by(engines, "affine") == 0
    finally:
        await group.close()


async def test_several_frontends_weigh_each_others_work_by_the_published_load(
        engines: list[FakeEngine]) -> None:
    one, two = await started(engines), await started(engines)
    try:
        PINNED_RANK.set(0)
        for i in range(6):  # frontend one keeps engine 0 busy
            one.add(f"busy-{i}", prompt(10 + i), LONG)
        PINNED_RANK.set(None)
        await until(lambda: two.clients[0][1].load is not None
                    and two.clients[0][1].load.running == 6)
        for i in range(3):  # frontend two sent nothing there, yet sends elsewhere
            two.add(f"other-{i}", prompt(20 + i), FAST)
            assert await served_by(engines, f"other-{i}") == 1
    finally:
        await one.close()
        await two.close()


async def test_pinning_the_n_choices_and_aborts(group: EngineGroup,
                                                engines: list[FakeEngine]) -> None:
    token = PINNED_RANK.set(1)
    try:
        group.add("pinned", prompt(1), FAST)
    finally:
        PINNED_RANK.reset(token)
    assert await served_by(engines, "pinned") == 1
    for n in range(3):  # each request's choices share one engine, whatever the loads say
        stream = OutputStream()
        for c in range(4):
            group.add(f"n{n}-{c}", prompt(30 + n), LONG, stream, c)
        assert len({await served_by(engines, f"n{n}-{c}") for c in range(4)}) == 1
    holder = {rid: await served_by(engines, rid) for rid in ("n0-1", "n2-3")}
    group.abort(["n0-1", "n2-3"])
    await until(lambda: all(rid in engines[r].aborted for rid, r in holder.items()))
    for fake in engines:  # an abort goes only to the engine that runs the request
        assert set(fake.aborted) <= {a.request_id for a in fake.added}


async def test_a_dead_engine_leaves_routing_and_fails_only_its_own_requests(
        group: EngineGroup, engines: list[FakeEngine]) -> None:
    PINNED_RANK.set(1)
    doomed = group.add("doomed", prompt(5), LONG)
    PINNED_RANK.set(0)
    living = group.add("living", prompt(6), SamplingParams(max_tokens=30))
    PINNED_RANK.set(None)
    await until(lambda: group.index.blocks[1] >= 4)
    engines[1].stop()
    with pytest.raises(EngineDeadError):
        while await asyncio.wait_for(doomed.get(), 3):
            pass
    await until(lambda: group.index.blocks[1] == 0)  # its cache is forgotten
    items = []
    while batch := await asyncio.wait_for(living.get(), 3):
        items += batch
    assert items[-1].finish_reason == "length"
    for i in range(4):  # everything new goes to the survivor, even its prefix's family
        group.add(f"after-{i}", prompt(5, suffix=i), FAST)
        assert await served_by(engines, f"after-{i}") == 0
    token = PINNED_RANK.set(1)
    with pytest.raises(EngineDeadError, match="engine 1"):
        group.add("pinned-to-the-dead", prompt(8), FAST)
    PINNED_RANK.reset(token)
    assert group.healthy


async def test_an_engine_silent_for_a_while_is_relearned_from_its_replay(
        group: EngineGroup, engines: list[FakeEngine]) -> None:
    PINNED_RANK.set(1)
    group.add("cached", prompt(9), FAST)
    PINNED_RANK.set(None)
    await until(lambda: group.index.blocks[1] >= 4)
    engines[1].silent = True
    await until(lambda: not group.clients[1][1].healthy and group.index.blocks[1] == 0)
    engines[1].silent = False  # it kept its cache, and publishes nothing new
    await until(lambda: group.index.blocks[1] >= 4)
    group.add("back", prompt(9, suffix=2), FAST)
    assert await served_by(engines, "back") == 1
