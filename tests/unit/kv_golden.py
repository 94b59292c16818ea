"""The golden KV-cache event frames (tests/data/kv_events/, recorded from vLLM 0.32.0's own
classes and from Tandem ca35ae9's array form) and their scenario, run through Tandem's block
manager: what the wire tests compare Tandem's bytes with."""

from __future__ import annotations

from pathlib import Path

import msgspec

from engine_core.sched.block_manager import BlockManager
from shared.block_hash import chain_hashes
from shared.kv_events import AllBlocksCleared, BlockStored, KvEvent, KVEventBatch

FOLDER = Path(__file__).resolve().parents[1] / "data" / "kv_events"
TOKENS = [1, 2, 3, 4, 5, 6]
BLOCK_SIZE = 2
H1, H2, H3 = chain_hashes(TOKENS, BLOCK_SIZE)  # the hashes record_vllm.py writes out
TS = [1.5, 2.5, 3.5, 4.5]
RANK = 1
TOPIC = b"kv@golden"


def messages(form: str, name: str) -> list[list[bytes]]:
    """`{form}_{name}.msgpack`: the ZeroMQ messages, each a list of frames."""
    return msgspec.msgpack.decode((FOLDER / f"{form}_{name}.msgpack").read_bytes())


def unranked(form: str) -> bytes:
    """The one batch without a data-parallel rank."""
    return (FOLDER / f"{form}_unranked.msgpack").read_bytes()


def unranked_batch() -> KVEventBatch:
    stored = BlockStored([H1, H2], None, TOKENS[:4], BLOCK_SIZE, None, "GPU", None)
    return KVEventBatch(1.5, [stored, AllBlocksCleared()])


def steps() -> list[list[KvEvent]]:
    """The scenario's four steps as Tandem's block manager records them: a chain of two blocks
    from no parent, one more block naming its parent, that block evicted, the cache cleared."""
    bm = BlockManager(3, BLOCK_SIZE)
    bm.record_events()
    first = bm.allocate(2)
    assert first is not None
    hashes = chain_hashes(TOKENS[:4], BLOCK_SIZE)
    bm.cache_full_blocks(first, TOKENS, hashes, 4, 0)
    stored = bm.take_events()
    more = bm.allocate(1)
    assert more is not None
    bm.cache_full_blocks(first + more, TOKENS, hashes, 6, 2)
    extended = bm.take_events()
    bm.free(first + more)
    bm.allocate(1)  # evicts the least recently freed cached block: the tail
    removed = bm.take_events()
    bm.reset_prefix_cache()
    return [stored, extended, removed, bm.take_events()]


def batches() -> list[KVEventBatch]:
    return [KVEventBatch(ts, events, RANK) for ts, events in zip(TS, steps(), strict=True)]
