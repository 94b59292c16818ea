"""KV-cache events: the block manager's record, the publisher's numbering, replay buffer, queue
and CURVE keys, the config. (The bytes against vLLM 0.32's own: test_kv_event_wire.py.)"""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from engine_core.sched.block_manager import BlockManager
from frontend.cli import main as tandem
from shared.block_hash import chain_hashes
from shared.curve import client_keys, secure_client, secure_server
from shared.engine_args import add_engine_args, engine_argv
from shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventsConfigError,
    parse_kv_events_config,
    rank_endpoint,
    reachable,
)
from shared.kv_publisher import KvEventPublisher
from tests import kv_subscriber


def publish(bm: BlockManager, tokens: list[int]) -> list[int]:
    blocks = bm.allocate(bm.blocks_needed(len(tokens)))
    assert blocks is not None
    bm.cache_full_blocks(blocks, tokens, chain_hashes(tokens, bm.block_size), len(tokens), 0)
    return blocks


def test_the_block_manager_records_nothing_unless_asked() -> None:
    bm = BlockManager(8, 4)
    publish(bm, list(range(12)))
    bm.reset_prefix_cache()
    assert bm.take_events() == []


def test_stored_blocks_carry_the_shared_chain_and_their_tokens() -> None:
    bm = BlockManager(8, 4)
    bm.record_events()
    tokens = list(range(100, 111))  # two full blocks and a partial one
    publish(bm, tokens)
    (stored,) = bm.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == chain_hashes(tokens, 4)
    assert stored.parent_block_hash is None and stored.block_size == 4
    assert stored.token_ids == tokens[:8] and stored.medium == "GPU"
    # a longer prompt over the same prefix stores only its new block, naming its parent
    longer = tokens + [7, 7, 7, 7, 7]
    blocks = bm.allocate(4)
    assert blocks is not None
    bm.cache_full_blocks(blocks, longer, chain_hashes(longer, 4), 16, 0)
    (more,) = bm.take_events()
    assert isinstance(more, BlockStored)
    assert more.block_hashes == chain_hashes(longer, 4)[2:]
    assert more.parent_block_hash == chain_hashes(tokens, 4)[1]
    assert more.token_ids == longer[8:16]


def test_evictions_and_a_reset_are_recorded() -> None:
    bm = BlockManager(2, 2)
    bm.record_events()
    tokens = [1, 2, 3, 4]
    bm.free(publish(bm, tokens))
    bm.take_events()
    bm.allocate(1)  # takes the least recently freed cached block: the tail, [3, 4]
    (removed,) = bm.take_events()
    assert removed == BlockRemoved([chain_hashes(tokens, 2)[1]], "GPU", group_idx=0)
    bm.reset_prefix_cache()
    assert bm.take_events() == [AllBlocksCleared()]


def test_config_takes_vllms_keys_and_refuses_others() -> None:
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "buffer_steps": 100, "hwm": 10, "topic": "kv"}')
    assert config.enabled and config.buffer_steps == 100 and config.topic == "kv"
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').kind == "zmq"
    assert not parse_kv_events_config('{"publisher": "zmq"}').enabled
    for bad in ('{"enable_kv_events": true}', '{"publisher": "kafka"}', '{"hwm": 0}', "[1]",
                '{"endpoint": "localhost:5557"}'):
        with pytest.raises(KvEventsConfigError):
            parse_kv_events_config(bad)


def test_each_rank_offsets_the_port_and_a_wildcard_is_reached_on_the_engines_host() -> None:
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert rank_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    assert reachable("tcp://*:5558", "tcp://10.0.0.7:5570") == "tcp://10.0.0.7:5558"
    assert reachable("tcp://0.0.0.0:5558", "ipc:///x") == "tcp://127.0.0.1:5558"
    assert reachable("ipc:///tmp/kv", "tcp://h:1") == "ipc:///tmp/kv"


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:  # type: ignore[type-arg]
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # (a failed test may leave sockets open: never hang)


def free_ports(n: int) -> list[int]:
    """Ports nothing listens on now (the OS's choice; a zmq socket's unbind frees its port
    only later, so a port taken from one may still be in use)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def subscriber(ctx: zmq.Context, address: str) -> zmq.Socket:  # type: ignore[type-arg]
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)
    return sub


def subscribed(pub: KvEventPublisher, sub: zmq.Socket,  # type: ignore[type-arg]
               timeout_s: float = 10.0) -> int:
    """Publish AllBlocksCleared until `sub` hears the latest one, and read what came: a PUB
    drops what it sends before a subscription has reached it, and how long that takes after
    the connect has no bound on a loaded machine (a fixed sleep lost the first events there).
    Returns how many batches it took; the test's own come after them."""
    deadline = time.monotonic() + timeout_s
    sent = 0
    while time.monotonic() < deadline:
        pub.publish([AllBlocksCleared()])
        sent += 1
        while sub.poll(100):
            if kv_subscriber.read(sub.recv_multipart())[1] == sent - 1:
                return sent
    raise AssertionError("the subscription never reached the publisher")


def test_published_batches_are_numbered_and_the_replay_keeps_the_last(
        ctx: zmq.Context, tmp_path: Path) -> None:  # type: ignore[type-arg]
    config = parse_kv_events_config(
        f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{tmp_path}/pub", '
        f'"replay_endpoint": "ipc://{tmp_path}/replay", "topic": "kv@tandem", '
        '"buffer_steps": 2}')
    pub = KvEventPublisher(config, rank=1, ctx=ctx)
    assert pub.bound == f"ipc://{tmp_path}/pub_dp1"
    sub = subscriber(ctx, pub.endpoint)
    first = subscribed(pub, sub)
    bm = BlockManager(4, 2)
    bm.record_events()
    tokens = [5, 6, 7, 8]
    publish(bm, tokens)
    pub.publish(bm.take_events())
    pub.publish([])  # nothing to say: no message, no sequence number
    bm.reset_prefix_cache()
    pub.publish(bm.take_events())
    pub.publish([BlockRemoved([1], "GPU")])
    got = []
    for _ in range(3):
        assert sub.poll(5000)
        got.append(kv_subscriber.read(sub.recv_multipart()))
    assert [(topic, seq) for topic, seq, _ in got] == [(b"kv@tandem", first + k)
                                                      for k in range(3)]
    batch = got[0][2]
    assert batch.data_parallel_rank == 1 and batch.ts == pytest.approx(time.time(), abs=30)
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == chain_hashes(tokens, 2) and stored.token_ids == tokens
    assert isinstance(got[1][2].events[0], AllBlocksCleared)
    # the replay buffer holds the last two batches: a start before them gets what is left
    replayed = kv_subscriber.replay(ctx, pub.replay_endpoint or "", 0)
    assert [(r.topic, r.seq) for r in replayed] == [(b"kv@tandem", first + 1),
                                                    (b"kv@tandem", first + 2)]
    assert isinstance(replayed[1].batch.events[0], BlockRemoved)
    assert kv_subscriber.replay(ctx, pub.replay_endpoint or "", first + 3) == []
    sub.close()
    pub.close()


def test_a_full_queue_drops_without_blocking_and_counts(
        ctx: zmq.Context, tmp_path: Path) -> None:  # type: ignore[type-arg]
    config = parse_kv_events_config(
        f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{tmp_path}/pub", '
        '"max_queue_size": 1}')
    pub = KvEventPublisher(config, rank=0, ctx=ctx)
    pub.close()  # the thread is gone: nothing drains the queue now
    started = time.monotonic()
    for _ in range(3):
        pub.publish([AllBlocksCleared()])
    assert pub.dropped == 2 and time.monotonic() - started < 0.5


def test_with_curve_keys_only_key_holders_get_the_events_and_the_replay(
        ctx: zmq.Context, tmp_path: Path) -> None:  # type: ignore[type-arg]
    assert tandem(["keys", str(tmp_path / "keys")]) == 0
    keys = tmp_path / "keys"
    router = ctx.socket(zmq.ROUTER)
    auth = secure_server(ctx, router, keys)  # the engine's own socket starts the authenticator
    try:
        pub_port, replay_port = free_ports(2)
        config = parse_kv_events_config(
            f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{pub_port}", '
            f'"replay_endpoint": "tcp://*:{replay_port}"}}')
        pub = KvEventPublisher(config, rank=0, ctx=ctx, curve_keys=keys)
        subs = {}
        for name, curve in (("keyed", client_keys(keys)), ("open", None)):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            if curve is not None:
                secure_client(sub, curve)
            sub.connect(f"tcp://127.0.0.1:{pub_port}")
            subs[name] = sub
        primed = subscribed(pub, subs["keyed"])  # the open one had as long, and as many
        pub.publish([AllBlocksCleared()])
        assert subs["keyed"].poll(5000)
        assert kv_subscriber.read(subs["keyed"].recv_multipart())[2].events == [AllBlocksCleared()]
        assert not subs["open"].poll(500)
        with pytest.raises(TimeoutError):
            kv_subscriber.replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0, timeout_ms=500)
        replayed = kv_subscriber.replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0,
                               curve=client_keys(keys))
        assert [r.seq for r in replayed] == list(range(primed + 1))
        for sub in subs.values():
            sub.close()
        pub.close()
    finally:
        auth.stop()
        router.close()


def test_the_format_flag_reaches_the_engine_and_names_one_of_the_two_forms() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).kv_events_format == "map"
    argv = engine_argv(parser.parse_args(["--kv-events-format", "array"]))
    assert argv[argv.index("--kv-events-format") + 1] == "array"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-events-format", "json"])
