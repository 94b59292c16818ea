"""Tandem's KV-cache event bytes against frames recorded from vLLM 0.32.0's own classes and
publisher (the map form) and from Tandem ca35ae9 (the array form): the encoder, the PUB
messages, the replay socket's answer, and the decoder, byte for byte (tests/data/kv_events/)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from engine_core.sched.block_manager import BlockManager
from shared.block_hash import chain_hashes, root_parent
from shared.kv_events import (
    FORMATS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KVEventBatch,
    KvEventDecoder,
    KvEventWire,
    parse_kv_events_config,
)
from shared.kv_publisher import KvEventPublisher
from tests.unit import kv_golden as golden


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:  # type: ignore[type-arg]
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_the_scenario_is_the_one_recorded() -> None:
    """The block manager's events are what record_vllm.py built with vLLM's structs."""
    stored, extended, removed, cleared = golden.steps()
    assert stored == [BlockStored([golden.H1, golden.H2], None, [1, 2, 3, 4], 2, None, "GPU",
                                  None, extra_keys=[None, None], group_idx=0)]
    assert extended == [BlockStored([golden.H3], golden.H2, [5, 6], 2, None, "GPU", None,
                                    extra_keys=[None], group_idx=0)]
    assert removed == [BlockRemoved([golden.H3], "GPU", group_idx=0)]
    assert cleared == [AllBlocksCleared()]
    assert golden.H3 >= 2**63  # a msgpack uint64 on the wire


@pytest.mark.parametrize("form", FORMATS)
def test_the_encoder_writes_the_recorded_bytes(form: str) -> None:
    wire = KvEventWire(form)  # type: ignore[arg-type]
    published = [payload for _, _, payload in golden.messages(form, "published")]
    assert [wire.encode(batch) for batch in golden.batches()] == published
    assert wire.encode(golden.unranked_batch()) == golden.unranked(form)


def test_the_map_form_is_vllm_0_32s_not_the_array_form() -> None:
    """The two forms differ, so each test above tells them apart."""
    assert golden.messages("map", "published") != golden.messages("array", "published")
    assert golden.unranked("map") != golden.unranked("array")


def receive(sock: zmq.Socket, count: int) -> list[list[bytes]]:  # type: ignore[type-arg]
    got = []
    for _ in range(count):
        assert sock.poll(5000), f"{len(got)} of {count} messages came"
        got.append(sock.recv_multipart())
    return got


@pytest.mark.parametrize("form", FORMATS)
def test_the_publisher_sends_and_replays_the_recorded_frames(
        form: str, ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    # inproc:// in one context: the subscription is in place when connect returns, where over
    # ipc:// or tcp:// a PUB drops what it sends before the subscription reaches it
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "endpoint": "inproc://kv", '
        '"replay_endpoint": "inproc://kv-replay", "topic": "kv@golden"}')
    clock = itertools.chain(golden.TS, itertools.repeat(0.0))
    pub = KvEventPublisher(config, rank=golden.RANK, ctx=ctx, form=form,  # type: ignore[arg-type]
                           clock=lambda: next(clock))
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    for events in golden.steps():
        pub.publish(events)
    assert receive(sub, 4) == golden.messages(form, "published")
    replay = ctx.socket(zmq.DEALER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.connect(pub.replay_endpoint or "")
    replay.send_multipart([b"", (1).to_bytes(8, "big")], flags=zmq.NOBLOCK)
    assert receive(replay, 4) == golden.messages(form, "replay")
    pub.close()


def without_map_fields(event: KvEvent) -> KvEvent:
    """What the array form carries of an event: no extra_keys or group_idx."""
    if isinstance(event, BlockStored):
        return msgspec.structs.replace(event, extra_keys=None, group_idx=None)
    if isinstance(event, BlockRemoved):
        return msgspec.structs.replace(event, group_idx=None)
    return event


@pytest.mark.parametrize("form", FORMATS)
def test_the_decoder_reads_the_recorded_batches(form: str) -> None:
    decoder = KvEventDecoder()  # one for both: a subscriber does not know an engine's form
    for (_, _, payload), want in zip(golden.messages(form, "published"), golden.batches(),
                                     strict=True):
        if form == "array":
            want.events = [without_map_fields(e) for e in want.events]
        assert decoder.decode(payload) == want
    assert decoder.decode(golden.unranked(form)) == golden.unranked_batch()


def test_a_batch_of_neither_form_is_refused_with_the_map_forms_complaint() -> None:
    bad = msgspec.msgpack.encode([1.5, [{"type": "BlockStored", "block_hashes": [1]}], 0])
    with pytest.raises(msgspec.ValidationError, match="missing required field"):
        KvEventDecoder().decode(bad)
    with pytest.raises(msgspec.DecodeError):
        KvEventDecoder().decode(b"\xc1")


def test_an_adapters_blocks_are_vllms_bytes() -> None:
    """Blocks of the LoRA adapter "alpha" (the server's first: lora_id 1), cached by Tandem's
    block manager, encode to the batch vLLM 0.32's classes wrote (map_lora.msgpack); the
    decoder reads it back."""
    bm = BlockManager(4, golden.BLOCK_SIZE)
    bm.record_events()
    blocks = bm.allocate(2)
    assert blocks is not None
    root = root_parent("alpha")
    hashes = chain_hashes(golden.TOKENS[:4], golden.BLOCK_SIZE, root=root)
    bm.cache_full_blocks(blocks, golden.TOKENS[:4], hashes, 4, 0, root, (1, "alpha"))
    batch = KVEventBatch(1.5, bm.take_events(), golden.RANK)
    recorded = (golden.FOLDER / "map_lora.msgpack").read_bytes()
    assert KvEventWire("map").encode(batch) == recorded
    assert KvEventDecoder().decode(recorded) == batch
    assert hashes[0] != golden.H1  # an adapter's chain is its own
