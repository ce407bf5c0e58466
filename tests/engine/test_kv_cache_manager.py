"""KVCacheManager: block tables, slots, prefix hits and all-or-nothing allocation."""

from __future__ import annotations

from engine.kv_cache_manager import NULL_BLOCK, KVCacheManager
from engine_builders import make_request
from models.kv_cache import kv_layout

BS = 16


def slots(block_ids: list[int], num_tokens: int, block_size: int = BS) -> list[int]:
    """Where the model runner writes each token's K/V."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(num_tokens)]


def admit(kv: KVCacheManager, request, num_new: int | None = None) -> int:
    """Admit like the scheduler does; returns the number of cached tokens."""
    blocks, num_cached = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_cached if num_new is None else num_new
    assert kv.allocate_slots(request, num_new, blocks)
    request.num_computed_tokens = num_cached
    return num_cached


def test_prompt_not_a_multiple_of_the_block_size_gets_a_partial_last_block():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = make_request("r0", range(20))
    admit(kv, r)
    assert kv.get_block_ids("r0") == [0, 1]
    assert slots(kv.get_block_ids("r0"), 20) == list(range(20))
    assert kv.stats.num_blocks_used == 2
    assert kv.stats.usage == 2 / 8
    assert kv.num_free_blocks == 6


def test_decode_adds_a_block_only_when_crossing_a_boundary():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = make_request("r0", range(15))
    admit(kv, r)
    r.num_computed_tokens = 15
    r.append_token(100)  # token 15 fills block 0
    assert kv.allocate_slots(r, 1)
    assert kv.get_block_ids("r0") == [0]
    r.num_computed_tokens = 16
    r.append_token(101)  # token 16 starts block 1
    assert kv.allocate_slots(r, 1)
    assert kv.get_block_ids("r0") == [0, 1]
    assert slots(kv.get_block_ids("r0"), 17)[-1] == 16


def test_shared_64_token_prefix_is_a_hit_counted_in_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prefix = list(range(1000, 1064))
    r0 = make_request("r0", prefix + [1, 2, 3, 4, 5])
    r1 = make_request("r1", prefix + [7, 8, 9])
    assert admit(kv, r0) == 0
    assert admit(kv, r1) == 64
    t0, t1 = kv.get_block_ids("r0"), kv.get_block_ids("r1")
    assert t0 == [0, 1, 2, 3, 4]
    assert t1 == [0, 1, 2, 3, 5]
    assert [kv.pool.ref_count(b) for b in t1] == [2, 2, 2, 2, 1]
    stats = kv.stats
    assert stats.prefix_cache_queries == 69 + 67
    assert stats.prefix_cache_hits == 64
    assert stats.num_blocks_used == 6


def test_hit_stops_at_the_first_differing_block():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_request("r0", range(64)))
    other = list(range(64))
    other[20] = -1  # block 1 differs, so blocks 2 and 3 cannot match either
    assert kv.get_computed_blocks(make_request("r1", other)) == ([[0]], 16)


def test_never_the_whole_prompt_is_a_hit():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_request("r0", range(64)))
    # A 64-token prompt that is fully cached still computes its last block.
    assert kv.get_computed_blocks(make_request("r1", range(64))) == ([[0, 1, 2]], 48)
    assert kv.get_computed_blocks(make_request("r2", range(65))) == ([[0, 1, 2, 3]], 64)
    assert kv.get_computed_blocks(make_request("r3", range(16))) == ([[]], 0)


def test_a_freed_request_blocks_are_still_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("r0", range(40)))
    kv.free("r0")
    assert kv.stats.num_blocks_used == 0
    assert kv.num_free_blocks == 8
    r1 = make_request("r1", range(40))
    assert admit(kv, r1) == 32
    assert kv.get_block_ids("r1")[:2] == [0, 1]
    assert kv.num_free_blocks == 5


def test_output_tokens_become_cacheable_once_their_block_is_full():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r0 = make_request("r0", range(15))
    admit(kv, r0)
    r0.num_computed_tokens = 15
    r0.append_token(99)
    assert kv.allocate_slots(r0, 1)
    r1 = make_request("r1", list(range(15)) + [99, 7])
    assert kv.get_computed_blocks(r1) == ([[0]], 16)


def test_sibling_admitted_after_a_chunk_hits_the_blocks_allocated_for_it():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(100))
    r0 = make_request("r0", prompt)
    admit(kv, r0, num_new=40)  # only a chunk: blocks 0 and 1 are full, block 2 is not
    assert kv.get_computed_blocks(make_request("r1", prompt)) == ([[0, 1]], 32)


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    prefix = list(range(32))
    admit(kv, make_request("r0", prefix + [1]))  # blocks 0, 1, 2
    kv.free("r0")  # all free; blocks 0 and 1 stay cached
    admit(kv, make_request("r1", range(500, 548)))  # takes uncached 2 first, then 3, 4
    before = (kv.get_block_ids("r1"), kv.num_free_blocks, kv.stats,
              [kv.pool.ref_count(b) for b in range(6)], kv.pool.free_block_ids())
    assert before[1] == 3

    r2 = make_request("r2", prefix + list(range(40)))  # 72 tokens: 5 blocks, 2 of them hits
    blocks, num_cached = kv.get_computed_blocks(r2)
    assert (blocks, num_cached) == ([[0, 1]], 32)
    assert not kv.allocate_slots(r2, 40, blocks)
    assert kv.get_block_ids("r2") == []
    after = (kv.get_block_ids("r1"), kv.num_free_blocks, kv.stats,
             [kv.pool.ref_count(b) for b in range(6)], kv.pool.free_block_ids())
    assert after == before
    # The hits were not taken, so they still count as free: a shorter chunk fits.
    assert kv.allocate_slots(r2, 16, blocks)
    assert kv.get_block_ids("r2") == [0, 1, 5]
    assert kv.num_free_blocks == 0


def test_free_is_idempotent():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    admit(kv, make_request("r0", range(20)))
    kv.free("r0")
    kv.free("r0")
    kv.free("never-seen")
    assert kv.num_free_blocks == 4
    assert kv.num_requests == 0
    assert [kv.pool.ref_count(b) for b in range(4)] == [0, 0, 0, 0]


def test_free_puts_a_request_tail_first_in_line_for_eviction():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    admit(kv, make_request("r0", range(48)))  # 3 full blocks, all cached
    kv.free("r0")
    # All three are cached; the last block of the request is evicted first.
    assert kv.pool.free_block_ids() == [2, 1, 0]


def test_prefix_caching_disabled_never_hits_or_counts():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    admit(kv, make_request("r0", range(40)))
    assert admit(kv, make_request("r1", range(40))) == 0
    assert kv.get_block_ids("r1") == [3, 4, 5]
    assert kv.pool.num_cached_blocks == 0
    assert (kv.stats.prefix_cache_queries, kv.stats.prefix_cache_hits) == (0, 0)


def test_preempted_request_is_not_counted_again():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = make_request("r0", range(40))
    admit(kv, r)
    kv.free("r0")
    r.num_preemptions = 1
    r.num_computed_tokens = 0
    admit(kv, r)
    assert (kv.stats.prefix_cache_queries, kv.stats.prefix_cache_hits) == (40, 0)


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    admit(kv, make_request("r0", range(40)))
    assert not kv.reset_prefix_cache()
    kv.free("r0")
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("r1", range(40))) == ([[]], 0)


def salted(request_id: str, tokens, salt: str | None, adapter: str | None = None):
    r = make_request(request_id, tokens)
    r.sampling_params.cache_salt = salt
    r.adapter = adapter
    return r


def test_a_cache_salt_shares_blocks_only_with_the_same_salt():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    prompt = list(range(1000, 1065))  # 4 full blocks and one token
    assert admit(kv, salted("plain", prompt, None)) == 0
    assert admit(kv, salted("a0", prompt, "tenant-a")) == 0  # not the unsalted blocks
    assert admit(kv, salted("b0", prompt, "tenant-b")) == 0  # nor another salt's
    assert admit(kv, salted("a1", prompt, "tenant-a")) == 64
    assert admit(kv, salted("plain1", prompt, None)) == 64
    assert kv.get_block_ids("a1")[:4] == kv.get_block_ids("a0")[:4] != kv.get_block_ids("plain")[:4]
    # A salt and an adapter both key the chain: the adapter's salted blocks are their own.
    assert admit(kv, salted("lora-a", prompt, "tenant-a", adapter="sql")) == 0
    assert admit(kv, salted("lora-a1", prompt, "tenant-a", adapter="sql")) == 64
    assert admit(kv, salted("lora", prompt, None, adapter="sql")) == 0


# -- a hybrid cache: a full group and a windowed one (models.kv_cache.KVLayout) --------------

def test_a_windowed_group_gives_back_the_blocks_its_window_left():
    kv = KVCacheManager(num_blocks=32, block_size=BS, group_windows=(0, 32))
    r = make_request("r0", range(100))
    admit(kv, r)  # a whole prompt in one step: both tables cover it while it runs
    full, windowed = kv.get_block_tables("r0")
    assert len(full) == len(windowed) == 7 and not set(full) & set(windowed)
    assert kv.num_free_blocks == 32 - 14
    r.num_computed_tokens = 100
    r.append_token(1)
    assert kv.allocate_slots(r, 1)
    # The next query (position 100) sees positions 69..100: blocks 0..3 (tokens 0..63) are left behind.
    full2, windowed2 = kv.get_block_tables("r0")
    assert full2 == full and windowed2 == [NULL_BLOCK] * 4 + windowed[4:]
    assert kv.num_free_blocks == 32 - 10
    kv.free("r0")
    assert kv.num_free_blocks == 32 and kv.stats.num_blocks_used == 0


def test_a_hybrid_prefix_hit_takes_the_full_blocks_and_the_windows_last_ones():
    kv = KVCacheManager(num_blocks=40, block_size=BS, group_windows=(0, 20))
    prompt = list(range(1000, 1100))  # 6 full blocks and 4 tokens
    r0 = make_request("r0", prompt)
    admit(kv, r0)
    full0, windowed0 = kv.get_block_tables("r0")
    kv.free("r0")
    (full, windowed), cached = kv.get_computed_blocks(make_request("r1", prompt + [5]))
    assert cached == 96 and full == full0[:6]
    # From position 96 on a query sees 77..: blocks 4 and 5 of the windowed group, not 0..3.
    assert windowed == [NULL_BLOCK] * 4 + windowed0[4:6]
    r1 = make_request("r1", prompt + [5])
    assert admit(kv, r1) == 96
    assert kv.get_block_tables("r1")[1][:6] == windowed


def test_a_hit_stops_where_the_window_finds_no_cached_blocks():
    kv = KVCacheManager(num_blocks=14, block_size=BS, group_windows=(0, 20))
    prompt = list(range(2000, 2100))
    r0 = make_request("r0", prompt)
    admit(kv, r0)
    r0.num_computed_tokens = 100
    r0.append_token(1)
    # Position 100 sees 81..: the windowed group gives back blocks 0..4 (cached, free).
    assert kv.allocate_slots(r0, 1)
    assert kv.num_free_blocks == 5
    # Another request takes four free blocks: the cached windowed blocks 0..3 are evicted.
    assert admit(kv, make_request("other", range(5000, 5032))) == 0  # 2 blocks in each group
    assert kv.num_free_blocks == 1
    kv.free("r0")
    # A hit of 6 blocks needs windowed blocks 4 and 5, still cached.
    (full, windowed), cached = kv.get_computed_blocks(make_request("r1", prompt + [5]))
    assert cached == 96 and windowed[:4] == [NULL_BLOCK] * 4
    # A prompt of 65 tokens wants a 4-block hit: its window needs block 3, which is gone.
    (_, windowed), cached = kv.get_computed_blocks(make_request("r2", prompt[:65]))
    assert cached == 0


def test_layouts_group_layers_by_window():
    # Gemma 3 270M: every sixth of 18 layers full, the others a 512-token window.
    windows = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    lay = kv_layout(windows, 18, 32768)
    assert lay.group_windows == (0, 512, 512, 512, 512, 512) and lay.num_slots == 3
    assert lay.layer_group[5] == lay.layer_group[11] == lay.layer_group[17] == 0
    assert sorted(zip(lay.layer_group, lay.layer_slot)) == [(g, s) for g in range(6) for s in range(3)]
    # One sequence of 8k tokens, 256 a step: the full group's 512 blocks, each windowed group's 49.
    assert lay.blocks_for(8192, 16, 256) == 512 + 5 * 49
    # Without the hybrid layout every layer keeps every block: one group.
    flat = kv_layout(windows, 18, 32768, hybrid=False)
    assert flat.group_windows == (0,) and flat.num_slots == 18 and flat.blocks_for(8192, 16, 256) == 512
    # A window as long as the context is full attention; one window everywhere is one group.
    assert kv_layout(windows, 18, 512).group_windows == (0,)
    assert kv_layout((4096,) * 4, 4, 32768).group_windows == (4096,)
    assert kv_layout((), 4, 32768) == kv_layout((0,) * 4, 4, 32768)
    # Uneven counts: Gemma 3 1B's 4 full and 22 windowed layers make groups of 4, the last of 2.
    windows = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))
    lay = kv_layout(windows, 26, 32768)
    assert lay.num_slots == 4 and lay.num_groups == 7 and lay.layer_group.count(6) == 2
