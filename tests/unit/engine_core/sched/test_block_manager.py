"""Block pool, hash chain and eviction order, without a model."""

from __future__ import annotations

from engine_core.sched.block_manager import BlockManager, chain_hashes


def test_chain_hashes_cover_full_blocks_only_and_extend():
    tokens = list(range(10))
    hashes = chain_hashes(tokens, 4)
    assert len(hashes) == 2
    assert chain_hashes(tokens + [10, 11], 4, hashes)[:2] == hashes
    assert len(chain_hashes(tokens + [10, 11], 4, hashes)) == 3


def test_chain_depends_on_the_whole_prefix():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chain_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second block, different parents


def test_allocate_and_free_count_blocks():
    bm = BlockManager(4, 4)
    got = bm.allocate(3)
    assert got == [0, 1, 2] and bm.num_free_blocks == 1
    assert bm.allocate(2) is None and bm.num_free_blocks == 1
    bm.free(got)
    assert bm.num_free_blocks == 4


def publish(bm: BlockManager, tokens: list[int]) -> list[int]:
    blocks = bm.allocate(bm.blocks_needed(len(tokens)))
    assert blocks is not None
    hashes = chain_hashes(tokens, bm.block_size)
    bm.cache_full_blocks(blocks, tokens, hashes, len(tokens), 0)
    return blocks


def test_prefix_lookup_hits_published_blocks_and_leaves_one_token():
    bm = BlockManager(8, 4)
    tokens = list(range(100, 112))  # three full blocks
    blocks = publish(bm, tokens)
    hit = bm.lookup_prefix(tokens, chain_hashes(tokens, 4))
    assert hit == blocks[:2]  # the last block is recomputed so the request has a token to run
    longer = tokens + [1, 2]
    assert bm.lookup_prefix(longer, chain_hashes(longer, 4)) == blocks[:3]
    other = [7] + tokens[1:]
    assert bm.lookup_prefix(other, chain_hashes(other, 4)) == []


def test_freed_cached_blocks_are_reused_until_evicted_lru():
    bm = BlockManager(4, 2)
    a = publish(bm, [1, 2, 3, 4])  # blocks 0, 1
    bm.free(a)  # tail first: block 1 is older in the free queue than block 0
    assert bm.num_free_blocks == 4
    hit = bm.lookup_prefix([1, 2, 3, 4, 5], chain_hashes([1, 2, 3, 4, 5], 2))
    assert hit == a
    bm.acquire(hit)
    assert bm.num_free_blocks == 2
    bm.free(hit)
    fresh = bm.allocate(3)  # blocks 2, 3 are never-used; then the oldest freed cached block
    assert fresh == [2, 3, 1]
    seq = [1, 2, 3, 4, 5]
    assert bm.lookup_prefix(seq, chain_hashes(seq, 2)) == [0]  # block 1 evicted, its key gone


def test_shared_block_has_two_references():
    bm = BlockManager(4, 2)
    a = publish(bm, [1, 2, 3])
    hit = bm.lookup_prefix([1, 2, 9], chain_hashes([1, 2, 9], 2))
    bm.acquire(hit)
    bm.free(a)
    assert bm.num_free_blocks == 3  # block 0 still held by the second user
    bm.free(hit)
    assert bm.num_free_blocks == 4


def test_disabled_prefix_caching_publishes_nothing():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    tokens = [1, 2, 3, 4, 5]
    publish(bm, tokens)
    assert bm.lookup_prefix(tokens, chain_hashes(tokens, 2)) == []


def test_reset_prefix_cache_forgets_every_prefix_and_keeps_blocks_in_use() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4]
    hashes = chain_hashes(tokens, 2)
    blocks = bm.allocate(2)
    assert blocks is not None
    bm.cache_full_blocks(blocks, tokens, hashes, num_computed=4, already=0)
    assert bm.lookup_prefix(tokens + [5], hashes) == blocks
    bm.reset_prefix_cache()
    assert bm.lookup_prefix(tokens + [5], hashes) == []
    bm.free(blocks)
    assert bm.num_free_blocks == 4



def test_free_queue_keeps_the_order_of_an_lru_queue_of_every_block():
    """FreeQueue (int32 arrays, the never-used blocks a range) against the structure it
    replaced: an ordered dict of every block, taken from the head, freed to the tail, and a
    freed block taken out from anywhere (a prefix hit on a free cached block)."""
    import random
    from collections import OrderedDict

    from engine_core.sched.block_manager import FreeQueue

    rng = random.Random(7)
    queue, model = FreeQueue(50), OrderedDict((b, None) for b in range(50))
    held: list[int] = []
    used: set[int] = set()  # blocks taken at least once: only those are ever hit while free
    for _ in range(5000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(0, min(5, len(model)))
            got = queue.pop(n)
            assert got == [model.popitem(last=False)[0] for _ in range(n)]
            held += got
            used.update(got)
        elif op < 0.8 and held:
            freed = [held.pop(rng.randrange(len(held))) for _ in range(rng.randint(0, len(held)))]
            queue.push(freed)
            model.update((b, None) for b in freed)
        else:
            freed = [b for b in model if b in used]
            if freed:
                b = rng.choice(freed)
                queue.remove(b)
                del model[b]
                held.append(b)
        assert queue.size == len(model)
    assert queue.pop(len(model)) == list(model)
