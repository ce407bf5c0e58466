"""BlockPool: block ids, ref counts, the prefix-cache map and eviction order."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, hash_block_tokens

BS = 4


def cache(pool: BlockPool, block_id: int, tokens: list[int], parent: bytes | None = None) -> bytes:
    """Register ``block_id`` as holding ``tokens``; returns its hash."""
    block_hash = hash_block_tokens(parent, tokens)
    assert pool.cache_block(block_id, block_hash, tokens)
    return block_hash


def test_fresh_pool_allocates_ids_in_ascending_order():
    pool = BlockPool(num_blocks=8, block_size=BS)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free_blocks == 3
    assert pool.num_used_blocks == 5


def test_allocating_more_than_free_raises_and_takes_nothing():
    pool = BlockPool(num_blocks=4, block_size=BS)
    pool.allocate(3)
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (4, 0)])
def test_invalid_sizes_are_rejected(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_ref_counts_on_share_and_free():
    pool = BlockPool(num_blocks=4, block_size=BS)
    [b] = pool.allocate(1)
    assert pool.ref_count(b) == 1
    pool.touch([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.ref_count(b) == 1
    assert b not in pool.free_block_ids()
    pool.free([b])
    assert pool.ref_count(b) == 0
    assert b in pool.free_block_ids()


def test_hit_returns_the_block_that_holds_the_tokens():
    pool = BlockPool(num_blocks=4, block_size=BS)
    [b] = pool.allocate(1)
    h = cache(pool, b, [1, 2, 3, 4])
    assert pool.get_cached_block(h, [1, 2, 3, 4]) == b
    assert pool.get_cached_block(hash_block_tokens(None, [1, 2, 3, 5]), [1, 2, 3, 5]) is None


def test_forced_hash_collision_does_not_hit():
    pool = BlockPool(num_blocks=4, block_size=BS)
    [b] = pool.allocate(1)
    h = cache(pool, b, [1, 2, 3, 4])
    # Same hash, other tokens: the stored token ids must veto the hit.
    assert pool.get_cached_block(h, [9, 9, 9, 9]) is None


def test_hash_chains_the_parent():
    tokens = [5, 6, 7, 8]
    root = hash_block_tokens(None, tokens)
    assert hash_block_tokens(None, tokens) == root
    assert hash_block_tokens(root, tokens) != root
    assert hash_block_tokens(hash_block_tokens(None, [1, 1, 1, 1]), tokens) != \
        hash_block_tokens(hash_block_tokens(None, [2, 2, 2, 2]), tokens)


def test_second_block_with_the_same_hash_stays_uncached():
    pool = BlockPool(num_blocks=4, block_size=BS)
    a, b = pool.allocate(2)
    h = cache(pool, a, [1, 2, 3, 4])
    assert not pool.cache_block(b, h, [1, 2, 3, 4])
    assert pool.get_cached_block(h, [1, 2, 3, 4]) == a
    assert pool.num_cached_blocks == 1


def test_freed_cached_block_counts_as_free_and_still_hits():
    pool = BlockPool(num_blocks=4, block_size=BS)
    [b] = pool.allocate(1)
    h = cache(pool, b, [1, 2, 3, 4])
    pool.free([b])
    assert pool.num_free_blocks == 4
    assert pool.num_used_blocks == 0
    assert pool.get_cached_block(h, [1, 2, 3, 4]) == b


def test_hit_on_a_free_cached_block_takes_it_off_the_free_queue():
    pool = BlockPool(num_blocks=4, block_size=BS)
    [b] = pool.allocate(1)
    cache(pool, b, [1, 2, 3, 4])
    pool.free([b])
    pool.touch([b])
    assert pool.ref_count(b) == 1
    assert pool.num_free_blocks == 3
    assert b not in pool.free_block_ids()
    # It is never handed out while held.
    assert b not in pool.allocate(3)


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(num_blocks=4, block_size=BS)
    b0, b1, b2, b3 = pool.allocate(4)
    cache(pool, b0, [1, 2, 3, 4])
    pool.free([b0, b1, b2, b3])
    # b1..b3 carry no hash: front of the queue; b0 keeps its hash: the end.
    assert pool.free_block_ids() == [b3, b2, b1, b0]
    assert pool.allocate(3) == [b3, b2, b1]
    assert pool.num_cached_blocks == 1


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(num_blocks=3, block_size=BS)
    b0, b1, b2 = pool.allocate(3)
    h0 = cache(pool, b0, [0, 0, 0, 0])
    h1 = cache(pool, b1, [1, 1, 1, 1])
    h2 = cache(pool, b2, [2, 2, 2, 2])
    pool.free([b1])
    pool.free([b2])
    pool.free([b0])
    assert pool.free_block_ids() == [b1, b2, b0]

    assert pool.allocate(1) == [b1]
    # Popping a cached block for reuse drops its hash (lazy eviction).
    assert pool.get_cached_block(h1, [1, 1, 1, 1]) is None
    assert pool.get_cached_block(h2, [2, 2, 2, 2]) == b2
    assert pool.get_cached_block(h0, [0, 0, 0, 0]) == b0
    assert pool.num_cached_blocks == 2


def test_touching_a_cached_block_refreshes_its_place_in_the_lru():
    pool = BlockPool(num_blocks=2, block_size=BS)
    b0, b1 = pool.allocate(2)
    cache(pool, b0, [0, 0, 0, 0])
    cache(pool, b1, [1, 1, 1, 1])
    pool.free([b0, b1])
    pool.touch([b0])
    pool.free([b0])
    assert pool.free_block_ids() == [b1, b0]


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(num_blocks=2, block_size=BS)
    [b] = pool.allocate(1)
    h = cache(pool, b, [1, 2, 3, 4])
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(h, [1, 2, 3, 4]) == b
    pool.free([b])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h, [1, 2, 3, 4]) is None
    assert pool.num_cached_blocks == 0
    assert pool.num_free_blocks == 2
