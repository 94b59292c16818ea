"""Paged KV blocks: allocation, reference counts and prefix caching.

A block is `block_size` token slots in the preallocated KV tensors. A full block whose KV
is computed gets a key in the prefix cache: its place in a hash chain over the token ids
(`block_key`), so a block is only reused after the very same prefix. Freed blocks go to the
tail of an LRU free queue but keep their key; allocation takes from the head and only then
evicts the key. A cached block that is hit while free is taken back out of the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockKey = tuple[int, tuple[int, ...]]


def block_key(parent_hash: int, tokens: Sequence[int]) -> BlockKey:
    """Key of a full block: the parent's hash and the block's own token ids.

    The dict compares whole keys, so two different prefixes can only share a block if the
    64-bit hashes of their parents collide *and* the block tokens are equal.
    """
    return (parent_hash, tuple(tokens))


def chain_hashes(token_ids: Sequence[int], block_size: int,
                 start: list[int] | None = None) -> list[int]:
    """Hash chain over the full blocks of `token_ids`, extending `start` (already hashed)."""
    hashes = list(start or [])
    parent = hashes[-1] if hashes else 0
    for i in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash(block_key(parent, token_ids[i:i + block_size]))
        hashes.append(parent)
    return hashes


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
        self._ref = [0] * num_blocks
        self._key_of: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.stats = PrefixStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup_prefix(self, token_ids: Sequence[int], hashes: Sequence[int]) -> list[int]:
        """Cached blocks for the longest cached prefix, leaving at least one token to compute."""
        max_blocks = (len(token_ids) - 1) // self.block_size
        found: list[int] = []
        parent = 0
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
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (evicting the least recently freed cached ones), or None if short."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            key = self._key_of[b]
            if key is not None:
                del self._cached[key]
                self._key_of[b] = None
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference each; tail blocks first so a prefix outlives its suffix in LRU."""
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def cache_full_blocks(self, blocks: Sequence[int], token_ids: Sequence[int],
                          hashes: Sequence[int], num_computed: int, already: int) -> int:
        """Publish blocks [already, num_computed // block_size) in the prefix cache.

        Returns the new count of published blocks for the caller to remember.
        """
        if not self.enable_prefix_caching:
            return already
        upto = min(num_computed // self.block_size, len(hashes))
        for i in range(already, upto):
            parent = hashes[i - 1] if i else 0
            key = block_key(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            b = blocks[i]
            if key not in self._cached and self._key_of[b] is None:
                self._cached[key] = b
                self._key_of[b] = key
        return max(upto, already)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's /reset_prefix_cache): blocks in use keep serving
        their requests, nothing is shared from them any more, and freed blocks return plain."""
        for block in self._cached.values():
            self._key_of[block] = None
        self._cached.clear()
