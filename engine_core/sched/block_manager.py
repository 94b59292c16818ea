"""Paged KV blocks: allocation, reference counts and prefix caching.

A block is `block_size` token slots in the preallocated KV tensors. A full block whose KV
is computed gets a key in the prefix cache: its place in a hash chain over the token ids
(`block_key`; the chain is `shared/block_hash.py`'s, which the frontends' router computes too),
so a block is only reused after the very same prefix. Freed blocks go to the
tail of an LRU free queue but keep their key; allocation takes from the head and only then
evicts the key. A cached block that is hit while free is taken back out of the queue.

Nothing here holds a Python object per block of the pool (a GPU's cache can have millions of
blocks): reference counts and the free queue live in int32 arrays sized once, and only cached
blocks have an entry in the prefix cache's dicts (docs/benchmarks.md, "Block manager").

With `record_events()`, what the prefix cache gains and loses is also recorded as vLLM's
KV-cache events (a block stored, evicted, or every block cleared), for the process to publish
(`shared/kv_publisher.py`); without it nothing is recorded and nothing is spent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.block_hash import ROOT_PARENT, block_hash, chain_hashes
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from shared.messages import ints

BlockKey = tuple[int, bytes]
MEDIUM = "GPU"  # vLLM's name for the engine's own KV cache (the tier routers look at)
GROUP = 0  # the events' KV-cache group: Tandem's cache is one group, vLLM's index 0
__all__ = ["BlockKey", "BlockManager", "FreeQueue", "block_key", "chain_hashes"]


def block_key(parent_hash: int, tokens: Sequence[int]) -> BlockKey:
    """Key of a full block: the parent's hash and the block's own token ids (as int32 bytes:
    ~0.2 KB a cached block, where a tuple of ints took ~0.8 KB of the engine's heap).

    The dict compares whole keys, so two different prefixes can only share a block if the
    64-bit hashes of their parents collide *and* the block tokens are equal.
    """
    return (parent_hash, ints(tokens))


class FreeQueue:
    """The free blocks in the order they are taken: never-used blocks first, ascending, then
    freed blocks, least recently freed first. The freed ones form a doubly linked list in two
    int32 arrays (slot `num_blocks` is its sentinel), so a block leaves from anywhere in O(1)."""

    def __init__(self, num_blocks: int) -> None:
        self._end = num_blocks  # the sentinel
        self._fresh = 0  # blocks [_fresh, num_blocks) were never used
        self._next = int32_slots(num_blocks + 1)
        self._prev = int32_slots(num_blocks + 1)
        self._next[num_blocks] = self._prev[num_blocks] = num_blocks
        self.size = num_blocks

    def pop(self, n: int) -> list[int]:
        """The first n blocks (n <= size)."""
        fresh = min(n, self._end - self._fresh)
        out = list(range(self._fresh, self._fresh + fresh))
        self._fresh += fresh
        nxt, end = self._next, self._end
        b = nxt[end]
        for _ in range(n - fresh):
            out.append(b)
            b = nxt[b]
        self._prev[b] = end
        nxt[end] = b
        self.size -= n
        return out

    def push(self, blocks: Sequence[int]) -> None:
        """Append freed blocks at the tail, in this order."""
        nxt, prev, end = self._next, self._prev, self._end
        last = prev[end]
        for b in blocks:
            nxt[last] = b
            prev[b] = last
            last = b
        nxt[last] = end
        prev[end] = last
        self.size += len(blocks)

    def remove(self, b: int) -> None:
        """Take out a freed block (a cached block hit while free)."""
        before, after = self._prev[b], self._next[b]
        self._next[before] = after
        self._prev[after] = before
        self.size -= 1


def int32_slots(n: int) -> memoryview:
    """n int32 slots, zeroed, in one array (pages the OS maps when first written): a
    memoryview reads and writes single slots as plain ints, at list speed."""
    return np.zeros(n, dtype=np.int32).data


@dataclass
class PrefixStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found cached


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = int32_slots(num_blocks)
        self._key_of: dict[int, BlockKey] = {}  # the cached blocks' keys
        self._cached: dict[BlockKey, int] = {}
        self._free = FreeQueue(num_blocks)
        self.stats = PrefixStats()
        self._events: list[KvEvent] | None = None  # None: nobody publishes them

    def record_events(self) -> None:
        """From now on, record the prefix cache's changes for `take_events`."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[KvEvent]:
        """The changes recorded since the last call, oldest first."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    @property
    def num_free_blocks(self) -> int:
        return self._free.size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup_prefix(self, token_ids: Sequence[int], hashes: Sequence[int],
                      root: int = ROOT_PARENT) -> list[int]:
        """Cached blocks for the longest cached prefix, leaving at least one token to compute."""
        max_blocks = (len(token_ids) - 1) // self.block_size
        found: list[int] = []
        parent = root
        for i in range(min(max_blocks, len(hashes))):
            start = i * self.block_size
            block = self._cached.get(block_key(parent, token_ids[start:start + self.block_size]))
            if block is None:
                break
            found.append(block)
            parent = hashes[i]
        return found

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks found by lookup_prefix."""
        for b in blocks:
            if self._ref[b] == 0:
                self._free.remove(b)
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (evicting the least recently freed cached ones), or None if short."""
        if n > self._free.size:
            return None
        out = self._free.pop(n)
        evicted: list[int] | None = [] if self._events is not None else None
        for b in out:
            key = self._key_of.pop(b, None)
            if key is not None:
                del self._cached[key]
                if evicted is not None:
                    evicted.append(block_hash(*key))
            self._ref[b] = 1
        if evicted and self._events is not None:
            self._events.append(BlockRemoved(evicted, MEDIUM, GROUP))
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference each; tail blocks first so a prefix outlives its suffix in LRU."""
        ref, freed = self._ref, []
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                freed.append(b)
        self._free.push(freed)

    def cache_full_blocks(self, blocks: Sequence[int], token_ids: Sequence[int],
                          hashes: list[int], num_computed: int, already: int,
                          root: int = ROOT_PARENT,
                          lora: tuple[int, str] | None = None) -> int:
        """Publish blocks [already, num_computed // block_size) in the prefix cache, `hashes`
        (the chain over `token_ids`' full blocks) extended in place as far as it needs: each
        block's tokens are packed once, for its hash and its key.

        `lora`: the request's adapter (id, name), for the KV events.
        Returns the new count of published blocks for the caller to remember.
        """
        if not self.enable_prefix_caching:
            return already
        bs = self.block_size
        upto = num_computed // bs
        if len(hashes) < already:
            hashes[:] = chain_hashes(token_ids[:already * bs], bs, hashes, root)
        stored: list[int] = []  # the blocks of this call that are newly cached
        cached, key_of = self._cached, self._key_of
        for i in range(already, upto):
            parent = hashes[i - 1] if i else root
            key = block_key(parent, token_ids[i * bs:(i + 1) * bs])
            if i == len(hashes):
                hashes.append(block_hash(*key))
            b = blocks[i]
            if key not in cached and b not in key_of:
                cached[key] = b
                key_of[b] = key
                stored.append(i)
        if stored and self._events is not None:
            self._events.extend(self._stored_events(stored, token_ids, hashes, lora))
        return max(upto, already)

    def _stored_events(self, stored: list[int], token_ids: Sequence[int],
                       hashes: Sequence[int],
                       lora: tuple[int, str] | None = None) -> list[BlockStored]:
        """One BlockStored per run of consecutive chain positions (vLLM's shape: a run names
        its first block's parent, and carries every block's tokens). As vLLM 0.32's block
        pool fills them for a prompt without images or a cache salt: each block's extra keys
        are None, or with a LoRA adapter its name alone, `(name,)`, beside the run's
        `lora_id` and `lora_name`."""
        lora_id, lora_name = lora if lora is not None else (None, None)
        extra = None if lora_name is None else (lora_name,)
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        bs = self.block_size
        return [BlockStored(block_hashes=[hashes[i] for i in run],
                            parent_block_hash=hashes[run[0] - 1] if run[0] else None,
                            token_ids=list(token_ids[run[0] * bs:(run[-1] + 1) * bs]),
                            block_size=bs, lora_id=lora_id, medium=MEDIUM,
                            lora_name=lora_name, extra_keys=[extra] * len(run),
                            group_idx=GROUP)
                for run in runs]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's /reset_prefix_cache): blocks in use keep serving
        their requests, nothing is shared from them any more, and freed blocks return plain."""
        self._key_of.clear()
        self._cached.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
