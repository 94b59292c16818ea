"""A KV-cache event subscriber for the tests, as an external router is one: the PUB messages and
the replay socket's protocol of vLLM 0.32's publisher, decoded by Tandem's `KvEventDecoder`
(which tests/unit/shared/test_kv_events.py holds to frames recorded from vLLM 0.32.0's own
classes, tests/data/kv_events/).

PUB frames `[topic, seq (8 bytes, big-endian), payload]`; the replay ROUTER takes an 8-byte
start sequence and answers `[topic, seq, payload]` per buffered batch, then
`[b"", -1 (8 bytes, signed), b""]` (the array form: the same without the topic frame).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import zmq

from shared.kv_events import KVEventBatch, KvEventDecoder, read_seq

DECODER = KvEventDecoder()


class Replayed(NamedTuple):
    topic: bytes | None  # None: the array form's layout, which has no topic frame
    seq: int
    batch: KVEventBatch


def read(frames: list[bytes]) -> tuple[bytes, int, KVEventBatch]:
    """One PUB message: (topic, seq, batch)."""
    topic, seq, payload = frames
    return topic, read_seq(seq), DECODER.decode(payload)


def replay(ctx: zmq.Context, address: str, start: int,  # type: ignore[type-arg]
           timeout_ms: int = 5000, curve: Any = None) -> list[Replayed]:
    """Every batch the replay socket holds from `start`, asked from a DEALER (a REQ socket takes
    one answer only). `curve`: Tandem's client keys, for an engine started with --curve-keys."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)  # no peer yet must not block the test for ever
    if curve is not None:
        from shared.curve import secure_client

        secure_client(sock, curve)
    sock.connect(address)
    got = []
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            if not sock.poll(timeout_ms):
                raise TimeoutError("no end marker from the replay socket")
            empty, *frames = sock.recv_multipart()
            assert empty == b"" and len(frames) in (2, 3), frames
            topic = frames[0] if len(frames) == 3 else None
            number, payload = read_seq(frames[-2]), frames[-1]
            if number == -1:
                assert payload == b"" and topic in (b"", None)
                return got
            got.append(Replayed(topic, number, DECODER.decode(payload)))
    except zmq.Again:
        raise TimeoutError("the replay request could not be sent") from None
    finally:
        sock.close()
