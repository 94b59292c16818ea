"""What each engine holds in its prefix cache, as its KV-cache events tell this frontend.

`BlockIndex` maps every cached block hash (the chain of `shared/block_hash.py`, which this
frontend also computes for each prompt) to a bitmask of the engines that hold it, so the
longest cached prefix on every engine at once costs one dict lookup per block of the prompt,
whatever the caches' size. `KvEventFeed` keeps one engine's part of it current: it subscribes to
the engine's PUB socket (vLLM's wire format, in either form: `shared/kv_events.py`), asks the
replay socket for what was published before it came, and again on a gap in the sequence
numbers. A sequence that goes back means a new engine at that address: its old blocks are
forgotten.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio

from shared.curve import ClientKeys, secure_client
from shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventDecoder,
    read_seq,
    seq_bytes,
)

logger = logging.getLogger(__name__)
REPLAY_TIMEOUT_S = 5.0


class BlockIndex:
    """Block hash -> bitmask of the engines (by rank) whose prefix cache holds it."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self.blocks: Counter[int] = Counter()  # blocks held, per rank

    def store(self, rank: int, hashes: Sequence[int]) -> None:
        bit, holders = 1 << rank, self._holders
        for h in hashes:
            mask = holders.get(h, 0)
            if not mask & bit:
                holders[h] = mask | bit
                self.blocks[rank] += 1

    def remove(self, rank: int, hashes: Sequence[int]) -> None:
        bit, holders = 1 << rank, self._holders
        for h in hashes:
            mask = holders.get(h, 0)
            if mask & bit:
                self.blocks[rank] -= 1
                if mask == bit:
                    del holders[h]
                else:
                    holders[h] = mask & ~bit

    def clear(self, rank: int) -> None:
        """Forget everything of one engine (a scan of the index: it happens when an engine
        resets its cache or is replaced)."""
        bit = 1 << rank
        for h, mask in list(self._holders.items()):
            if mask & bit:
                if mask == bit:
                    del self._holders[h]
                else:
                    self._holders[h] = mask & ~bit
        del self.blocks[rank]

    def longest_prefix(self, hashes: Sequence[int], candidates: int) -> tuple[int, int]:
        """(blocks, holders): how many leading blocks of the chain `hashes` some engine of the
        bitmask `candidates` holds, and the bitmask of those that hold that many (0, 0 if
        none holds the first)."""
        depth, mask = 0, candidates
        holders = self._holders
        for h in hashes:
            held = holders.get(h, 0) & mask
            if not held:
                break
            mask, depth = held, depth + 1
        return (depth, mask) if depth else (0, 0)


class KvEventFeed:
    """One engine's KV-cache events into the shared index; `run()` until cancelled."""

    def __init__(self, rank: int, index: BlockIndex, endpoint: str, replay: str | None,
                 ctx: zmq.asyncio.Context, curve: ClientKeys | None = None) -> None:
        self.rank = rank
        self.index = index
        self.endpoint = endpoint
        self.replay_endpoint = replay
        self._ctx = ctx
        self._curve = curve
        self._decoder = KvEventDecoder()
        self.last_seq = -1  # the last batch applied

    def forget(self) -> None:
        """The engine is gone: its cache with it. Whatever comes next starts from nothing."""
        self.index.clear(self.rank)
        self.last_seq = -1

    async def resync(self) -> None:
        """Catch up from the replay buffer now (an engine that answers again after a silence
        keeps its cache, and may publish nothing more for a while)."""
        await self._catch_up(self.last_seq + 1)

    async def run(self) -> None:
        sub = self._socket(zmq.SUB, self.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            await self._catch_up(0)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    logger.warning("engine %d: dropped a KV-event message of %d frame(s)",
                                   self.rank, len(frames))
                    continue
                seq = read_seq(frames[1])
                if seq <= self.last_seq:  # numbering started again: a new engine
                    logger.info("engine %d: KV events start over (a new engine); its blocks "
                                "are forgotten", self.rank)
                    self.forget()
                if seq > self.last_seq + 1:  # missed some: what the replay buffer still has
                    await self._catch_up(self.last_seq + 1)
                if seq > self.last_seq:  # not already among the replayed
                    self._apply(seq, frames[2])
        finally:
            sub.close(linger=0)

    def _socket(self, kind: int, address: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            secure_client(sock, self._curve)
        sock.connect(address)
        return sock

    async def _catch_up(self, start: int) -> None:
        """Apply what the replay socket still holds from `start` on (best effort: a batch it
        no longer holds is lost, and with it only some routing precision)."""
        if self.replay_endpoint is None:
            return
        sock = self._socket(zmq.DEALER, self.replay_endpoint)
        try:
            await sock.send_multipart([b"", seq_bytes(start)])
            while True:  # [b"", (topic,) seq, payload]: vLLM 0.32 sends the topic, older not
                frames = await asyncio.wait_for(sock.recv_multipart(), REPLAY_TIMEOUT_S)
                seq = read_seq(frames[-2])
                if seq < 0:
                    return
                if seq > self.last_seq:
                    self._apply(seq, frames[-1])
        except TimeoutError:
            logger.warning("engine %d: no answer from its KV-event replay socket %s", self.rank,
                           self.replay_endpoint)
        finally:
            sock.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            logger.warning("engine %d: dropped a KV-event batch that does not decode: %s",
                           self.rank, exc)
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.index.store(self.rank, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.index.remove(self.rank, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.index.clear(self.rank)
