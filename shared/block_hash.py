"""The prefix cache's hash chain over full blocks of token ids, one definition for both sides.

The engine's block manager keys its cached blocks by this chain, publishes it in its KV-cache
events (`shared/kv_events.py`), and the frontends' router computes it for every prompt to find
which engine already holds the longest prefix (`frontend/engine/kv_index.py`): the two must
agree bit for bit, across processes and hosts. So the hash is not Python's `hash()`, which is
salted per process, but XXH3-64 of the block's token ids as little-endian int32 bytes, seeded
with the parent block's hash (0 for a prompt's first block): a block's hash names the whole
prefix up to and including it. The values are unsigned 64-bit ints, vLLM's "int block hashes"
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`), which external KV-event consumers accept.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from shared.messages import ints

ROOT_PARENT = 0  # the seed of a prompt's first block


def root_parent(lora: str | None) -> int:
    """The seed of a prompt's first block: ROOT_PARENT for the base model; for a LoRA
    adapter, the hash of its name, so that two adapters (or an adapter and the base model)
    never share a cached block, whatever their prompts."""
    return ROOT_PARENT if not lora else xxhash.xxh3_64_intdigest(b"lora:" + lora.encode())


def block_hash(parent: int, block_tokens: bytes) -> int:
    """The hash of one full block: its int32 little-endian token bytes, seeded by its parent's."""
    return xxhash.xxh3_64_intdigest(block_tokens, parent)


def chain_hashes(token_ids: Sequence[int], block_size: int,
                 start: list[int] | None = None, root: int = ROOT_PARENT) -> list[int]:
    """The chain over the full blocks of `token_ids`, extending `start` (already hashed),
    from `root` (`root_parent`)."""
    hashes = list(start or [])
    first, end = len(hashes), len(token_ids) // block_size
    if end <= first:
        return hashes
    packed = ints(token_ids[first * block_size:end * block_size])
    width = 4 * block_size
    parent = hashes[-1] if hashes else root
    for offset in range(0, len(packed), width):
        parent = xxhash.xxh3_64_intdigest(packed[offset:offset + width], parent)
        hashes.append(parent)
    return hashes
