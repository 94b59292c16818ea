"""The frontend's KV-event subscriber reads frames recorded from vLLM 0.32.0's own publisher (and
the array form Tandem published before): the PUB messages and the replay socket's answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import zmq
import zmq.asyncio

from frontend.engine.kv_index import BlockIndex, KvEventFeed
from shared.kv_events import FORMATS, read_seq
from tests.unit import kv_golden as golden

CHAIN = [golden.H1, golden.H2, golden.H3]
BOTH = 0b11  # the engines a prefix is looked up on: ranks 0 and 1


async def until(done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not done():
            await asyncio.sleep(0.01)


async def answer_replays(router: zmq.asyncio.Socket, answers: list[list[list[bytes]]],
                         starts: list[int]) -> None:
    """A replay ROUTER that answers each request with the next of `answers` (messages as the
    client's DEALER receives them), noting each request's start."""
    for answer in answers:
        identity, _, start = await router.recv_multipart()
        starts.append(read_seq(start))
        for message in answer:
            await router.send_multipart([identity, *message])


@pytest.mark.parametrize("form", FORMATS)
async def test_the_feed_follows_the_recorded_messages_and_replay(form: str) -> None:
    # inproc:// in one context: the feed's subscription is in place once it has asked for the
    # replay (over ipc:// or tcp:// a PUB drops what it sends before the subscription arrives)
    ctx = zmq.asyncio.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind("inproc://kv")
    router.bind("inproc://kv-replay")
    published = golden.messages(form, "published")
    replayed = golden.messages(form, "replay")  # batches 1 to 3, then the end marker
    starts: list[int] = []
    # at the start nothing is buffered yet (the end marker alone); later, the recorded answer
    answering = asyncio.create_task(answer_replays(router, [replayed[-1:], replayed], starts))
    index = BlockIndex()
    feed = KvEventFeed(golden.RANK, index, "inproc://kv", "inproc://kv-replay", ctx)
    running = asyncio.create_task(feed.run())
    try:
        await until(lambda: starts == [0])
        await pub.send_multipart(published[0])  # the chain H1 H2 from no parent
        await until(lambda: feed.last_seq == 0)
        assert index.longest_prefix(CHAIN, BOTH) == (2, 1 << golden.RANK)
        await pub.send_multipart(published[1])  # H3, naming H2 its parent
        await until(lambda: feed.last_seq == 1)
        assert index.longest_prefix(CHAIN, BOTH) == (3, 1 << golden.RANK)
        await feed.resync()  # asks from 2: the answer's batch 1 is already applied, 2 and 3 not
        assert starts == [0, 2] and feed.last_seq == 3
        assert index.longest_prefix(CHAIN, BOTH) == (0, 0) and not +index.blocks
    finally:
        running.cancel()
        answering.cancel()
        await asyncio.gather(running, answering, return_exceptions=True)
        pub.close(linger=0)
        router.close(linger=0)
        ctx.destroy(linger=0)
