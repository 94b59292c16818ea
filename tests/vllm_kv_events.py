"""A KV-cache event reader written from vLLM 0.32's schema (vllm/distributed/kv_events.py), not
from Tandem's own structs: what an external router (llm-d, Dynamo) decodes. The tests check
Tandem's bytes against it, so a drift of Tandem's wire format from vLLM's fails them.

vLLM 0.32: `EventBatch(ts, events, data_parallel_rank=None)` array-like; `KVCacheEvent`
array-like, tagged with the class name; `BlockStored(block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name)`, `BlockRemoved(block_hashes, medium)`,
`AllBlocksCleared()`; `ExternalBlockHash = bytes | int`. PUB frames `[topic, seq (8 bytes,
big-endian), payload]`; the replay ROUTER takes an 8-byte start sequence and answers
`[seq, payload]` per buffered batch, then `[-1 (8 bytes, signed), b""]`.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def read(frames: list[bytes]) -> tuple[bytes, int, KVEventBatch]:
    """One PUB message: (topic, seq, batch)."""
    topic, seq, payload = frames
    return topic, int.from_bytes(seq, "big"), DECODER.decode(payload)


def replay(ctx: zmq.Context, address: str, start: int,  # type: ignore[type-arg]
           timeout_ms: int = 5000, curve: Any = None) -> list[tuple[int, KVEventBatch]]:
    """Ask the replay socket for every batch from `start`, as vLLM's example subscriber does
    (a REQ-style envelope from a DEALER, since the answer is several messages). `curve`:
    Tandem's client keys, for an engine started with --curve-keys."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # bounded: a refused CURVE handshake tears down the DEALER's only pipe, and a send after
    # that would block forever
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    if curve is not None:
        from shared.curve import secure_client

        secure_client(sock, curve)
    sock.connect(address)
    got = []
    try:
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
        except zmq.Again:
            raise TimeoutError("no connection to the replay socket to send on") from None
        while True:
            if not sock.poll(timeout_ms):
                raise TimeoutError("no end marker from the replay socket")
            _, seq, payload = sock.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                assert payload == b""
                return got
            got.append((number, DECODER.decode(payload)))
    finally:
        sock.close()
