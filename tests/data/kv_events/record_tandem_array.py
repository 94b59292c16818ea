"""Record the golden frames of the positional-array form as Tandem published it before vLLM's map
form became its default: commit ca35ae9, the form that consumers of Tandem read until then.

Run once, with that commit's code first on the path:

    git worktree add /tmp/tandem-ca35ae9 ca35ae9
    PYTHONPATH=/tmp/tandem-ca35ae9 .venv/bin/python tests/data/kv_events/record_tandem_array.py

It writes, beside itself, `array_published.msgpack`, `array_replay.msgpack` and
`array_unranked.msgpack` for the scenario of README.md: ca35ae9's block manager records the
events, its publisher (data-parallel rank 1) sends them, a SUB and a DEALER socket receive them.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import msgspec
import zmq

import shared.kv_publisher
from engine_core.sched.block_manager import BlockManager
from shared.block_hash import chain_hashes
from shared.kv_events import AllBlocksCleared, KVEventBatch, parse_kv_events_config
from shared.kv_publisher import KvEventPublisher

HERE = Path(__file__).resolve().parent
TOPIC = "kv@golden"
RANK = 1
TOKENS = [1, 2, 3, 4, 5, 6]


def steps() -> list[list[object]]:
    """The scenario's four steps, as the block manager records them (blocks of 2 tokens)."""
    bm = BlockManager(3, 2)
    bm.record_events()
    first = bm.allocate(2)
    assert first is not None
    hashes = chain_hashes(TOKENS[:4], 2)
    bm.cache_full_blocks(first, TOKENS, hashes, 4, 0)  # the chain from no parent
    stored = bm.take_events()
    more = bm.allocate(1)
    assert more is not None
    bm.cache_full_blocks(first + more, TOKENS, hashes, 6, 2)  # one more block, its parent named
    extended = bm.take_events()
    bm.free(first + more)
    bm.allocate(1)  # evicts the least recently freed cached block: the tail
    removed = bm.take_events()
    bm.reset_prefix_cache()
    return [stored, extended, removed, bm.take_events()]


def receive(sock: zmq.Socket, count: int) -> list[list[bytes]]:  # type: ignore[type-arg]
    got = []
    for _ in range(count):
        if not sock.poll(5000):
            sys.exit(f"recorded {len(got)} of {count} messages: the publisher went quiet")
        got.append(sock.recv_multipart())
    return got


def record(folder: str) -> dict[str, list[list[bytes]]]:
    clock = iter([1.5, 2.5, 3.5, 4.5])  # each batch's ts, as in record_vllm.py
    shared.kv_publisher.time = types.SimpleNamespace(time=lambda: next(clock))  # type: ignore[attr-defined]
    ctx = zmq.Context()
    config = parse_kv_events_config(
        f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{folder}/pub", '
        f'"replay_endpoint": "ipc://{folder}/replay", "topic": "{TOPIC}"}}')
    publisher = KvEventPublisher(config, rank=RANK, ctx=ctx)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    time.sleep(0.5)  # a PUB drops what it sends before the subscription reaches it
    for events in steps():
        publisher.publish(events)  # type: ignore[arg-type]
    published = receive(sub, 4)
    replay = ctx.socket(zmq.DEALER)
    replay.connect(publisher.replay_endpoint or "")
    replay.send_multipart([b"", (1).to_bytes(8, "big")])  # from seq 1: three batches and the end
    replayed = receive(replay, 4)
    sub.close(linger=0)
    replay.close(linger=0)
    publisher.close()
    ctx.destroy(linger=0)
    return {"published": published, "replay": replayed}


def note_versions(files: str, versions: str) -> None:
    """This recording's line of VERSIONS (the other recorder keeps its own)."""
    path = HERE / "VERSIONS"
    lines = path.read_text().splitlines() if path.exists() else []
    kept = [line for line in lines if not line.startswith(f"{files}:")]
    path.write_text("".join(f"{line}\n" for line in sorted([*kept, f"{files}: {versions}"])))


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        frames = record(folder)
    for name, messages in frames.items():
        (HERE / f"array_{name}.msgpack").write_bytes(msgspec.msgpack.encode(messages))
    stored = steps()[0][0]
    unranked = KVEventBatch(1.5, [stored, AllBlocksCleared()])  # type: ignore[list-item]
    (HERE / "array_unranked.msgpack").write_bytes(msgspec.msgpack.encode(unranked))
    code = Path(shared.kv_publisher.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    note_versions("array_*.msgpack", f"Tandem {commit}, msgspec {msgspec.__version__}, "
                  f"pyzmq {zmq.__version__}, Python {sys.version.split()[0]}")
    print(f"wrote {HERE}/array_*.msgpack with Tandem {commit}")


if __name__ == "__main__":
    main()
