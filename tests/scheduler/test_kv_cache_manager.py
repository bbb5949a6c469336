from __future__ import annotations

from collections.abc import Sequence

import pytest

from pagedserve.scheduler import KVCacheManager, Request, SamplingParams, kv_allocator
from pagedserve.scheduler.block_hash import BlockHash

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: Sequence[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams())


def admit(kv: KVCacheManager, request: Request) -> list[int] | None:
    """Admit like the scheduler does: reuse the cached prefix, compute the rest."""
    blocks, num_cached_tokens = kv.get_computed_blocks(request)
    new_ids = kv.allocate_slots(request, request.num_tokens - num_cached_tokens, blocks)
    if new_ids is not None:
        request.num_computed_tokens = request.num_tokens
    return new_ids


def decode(kv: KVCacheManager, request: Request, token_id: int) -> list[int] | None:
    """Append a sampled token and grant the slot for computing it."""
    request.append_output_token_ids(token_id)
    new_ids = kv.allocate_slots(request, 1)
    if new_ids is not None:
        request.num_computed_tokens += 1
    return new_ids


def ref_cnts(kv: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in kv.block_pool.blocks]


def free_list(kv: KVCacheManager) -> list[int]:
    return kv.block_pool.free_block_ids()


def test_allocate_append_free_exact_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", range(10))
    assert admit(kv, request) == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert ref_cnts(kv) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert (kv.num_free_blocks, kv.num_used_blocks, kv.num_total_blocks) == (5, 3, 8)
    assert kv.usage == pytest.approx(3 / 8)
    # Tokens 10 and 11 fit in block 2; token 12 opens block 3.
    assert decode(kv, request, 100) == []
    assert decode(kv, request, 101) == []
    assert decode(kv, request, 102) == [3]
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert free_list(kv) == [4, 5, 6, 7]
    kv.free(request)
    assert kv.get_block_ids("a") == []
    # Reverse order: the table's tail is evicted first.
    assert free_list(kv) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert ref_cnts(kv) == [0] * 8
    assert (kv.num_free_blocks, kv.num_used_blocks) == (8, 0)
    kv.free(request)  # freeing a request that holds nothing is a no-op
    assert free_list(kv) == [4, 5, 6, 7, 3, 2, 1, 0]


def test_only_full_blocks_of_known_tokens_are_cached() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", range(10))
    admit(kv, request)
    cached = [block.block_hash is not None for block in kv.block_pool.blocks]
    assert cached == [True, True, False, False, False, False, False, False]
    decode(kv, request, 100)
    assert kv.block_pool.blocks[2].block_hash is None
    decode(kv, request, 101)  # token 11 fills block 2
    assert kv.block_pool.blocks[2].block_hash is not None
    assert kv.block_pool.blocks[2].block_hash.token_ids == (8, 9, 100, 101)
    assert kv.block_pool.num_cached_blocks == 3


def test_prefix_hit_shares_exact_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("a", range(10))
    admit(kv, first)
    second = make_request("b", [*range(8), 50, 51, 52])
    blocks, num_cached_tokens = kv.get_computed_blocks(second)
    assert [block.block_id for block in blocks] == [0, 1]
    assert num_cached_tokens == 8
    assert kv.allocate_slots(second, 3, blocks) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert ref_cnts(kv) == [2, 2, 1, 1, 0, 0, 0, 0]
    kv.free(first)
    assert ref_cnts(kv) == [1, 1, 0, 1, 0, 0, 0, 0]
    assert free_list(kv) == [4, 5, 6, 7, 2]
    kv.free(second)
    assert free_list(kv) == [4, 5, 6, 7, 2, 3, 1, 0]
    assert kv.num_used_blocks == 0


def test_hit_is_capped_below_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", range(9)))
    # Same 8 tokens: the second block holds the last token, which must be recomputed.
    blocks, num_cached_tokens = kv.get_computed_blocks(make_request("b", range(8)))
    assert ([block.block_id for block in blocks], num_cached_tokens) == ([0], 4)
    # One token more and both full blocks are reusable.
    blocks, num_cached_tokens = kv.get_computed_blocks(make_request("c", range(9)))
    assert ([block.block_id for block in blocks], num_cached_tokens) == ([0, 1], 8)
    # A prompt shorter than a block never hits.
    assert kv.get_computed_blocks(make_request("d", range(4))) == ([], 0)


def test_hit_stops_at_first_miss() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", range(13)))
    # Block 1 differs, block 2 has the same tokens as a's block 2 but a different prefix.
    request = make_request("b", [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12])
    blocks, num_cached_tokens = kv.get_computed_blocks(request)
    assert ([block.block_id for block in blocks], num_cached_tokens) == ([0], 4)


def test_freed_prefix_is_revived_and_evicted_in_lru_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("a", range(10))
    admit(kv, first)
    kv.free(first)
    assert free_list(kv) == [3, 4, 5, 6, 7, 2, 1, 0]
    # Revived from the free list (ref_cnt 0 -> 1), no recompute of the prefix.
    again = make_request("a2", [*range(8), 60, 61])
    assert admit(kv, again) == [3]
    assert kv.get_block_ids("a2") == [0, 1, 3]
    assert free_list(kv) == [4, 5, 6, 7, 2]
    kv.free(again)
    assert free_list(kv) == [4, 5, 6, 7, 2, 3, 1, 0]
    # Unrelated request takes 6 blocks: 4 5 6 7 2 3 (3 was never full: not cached).
    other = make_request("x", range(100, 124))
    assert admit(kv, other) == [4, 5, 6, 7, 2, 3]
    assert kv.block_pool.blocks[1].block_hash is not None
    # One more block evicts block 1 (least recently freed of the cached ones): the hit
    # for a's prompt shrinks to block 0 alone.
    assert decode(kv, other, 124) == [1]
    assert free_list(kv) == [0]
    blocks, num_cached_tokens = kv.get_computed_blocks(make_request("a3", range(10)))
    assert ([block.block_id for block in blocks], num_cached_tokens) == ([0], 4)


def test_cached_free_blocks_count_as_capacity_but_not_twice() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    first = make_request("a", range(9))
    admit(kv, first)
    kv.free(first)  # blocks 0 and 1 stay cached in the free list
    holder = make_request("x", range(100, 108))
    assert admit(kv, holder) == [3, 4]
    assert free_list(kv) == [2, 1, 0]
    # 13 tokens = 4 blocks: 2 hit blocks revived + 2 fresh, but reviving the hits leaves
    # only block 2 free. Refused, and nothing changes.
    too_big = make_request("b", [*range(8), 70, 71, 72, 73, 74])
    assert admit(kv, too_big) is None
    assert kv.get_block_ids("b") == []
    assert free_list(kv) == [2, 1, 0]
    assert ref_cnts(kv) == [0, 0, 0, 1, 1]
    assert kv.block_pool.get_cached_block(kv.block_pool.blocks[1].block_hash) is not None
    # 12 tokens = 3 blocks: 2 revived + 1 fresh fits exactly.
    fits = make_request("c", [*range(8), 70, 71, 72, 73])
    assert admit(kv, fits) == [2]
    assert kv.get_block_ids("c") == [0, 1, 2]
    assert (kv.num_free_blocks, kv.num_used_blocks) == (0, 5)
    kv.free(fits)
    kv.free(holder)
    assert free_list(kv) == [2, 1, 0, 4, 3]
    assert kv.num_free_blocks == 5


def test_refused_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", range(12)))
    request = make_request("b", range(50, 58))
    assert kv.allocate_slots(request, 8) is None
    assert kv.get_block_ids("b") == []
    assert free_list(kv) == [3]
    assert kv.allocate_slots(request, 4) == [3]


def test_hash_collision_is_guarded_by_token_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    def colliding_hash(
        parent: BlockHash | None, token_ids: Sequence[int], root: bytes
    ) -> BlockHash:
        return BlockHash(b"every block collides", tuple(token_ids))

    monkeypatch.setattr(kv_allocator, "hash_block_tokens", colliding_hash)
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same digest everywhere: only blocks whose tokens match are hits.
    blocks, num_cached_tokens = kv.get_computed_blocks(
        make_request("b", [1, 2, 3, 4, 9, 9, 9, 9, 9])
    )
    assert ([block.block_id for block in blocks], num_cached_tokens) == ([0], 4)
    assert kv.get_computed_blocks(make_request("c", [7, 7, 7, 7, 5, 6, 7, 8, 0])) == ([], 0)


def test_duplicate_content_is_not_cached_twice() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first, second = make_request("a", range(5)), make_request("b", range(5))
    # Both computed before either could hit (e.g. admitted without a lookup).
    assert kv.allocate_slots(first, 5) == [0, 1]
    assert kv.allocate_slots(second, 5) == [2, 3]
    assert kv.block_pool.blocks[0].block_hash is not None
    assert kv.block_pool.blocks[2].block_hash is None
    blocks, _ = kv.get_computed_blocks(make_request("c", range(5)))
    assert [block.block_id for block in blocks] == [0]


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    first = make_request("a", range(10))
    assert admit(kv, first) == [0, 1, 2]
    assert [block.block_hash for block in kv.block_pool.blocks] == [None] * 8
    second = make_request("b", range(10))
    assert kv.get_computed_blocks(second) == ([], 0)
    assert admit(kv, second) == [3, 4, 5]
    assert kv.num_prefix_cache_hits_tokens == 0
    kv.free(first)
    kv.free(second)
    assert free_list(kv) == [6, 7, 2, 1, 0, 5, 4, 3]


def test_prefix_cache_counters_count_each_admission_once() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", range(10)))
    waiting = make_request("b", range(10))
    kv.get_computed_blocks(waiting)  # a refused attempt would look up again: not counted
    admit(kv, waiting)
    assert kv.num_prefix_cache_queries_tokens == 20
    assert kv.num_prefix_cache_hits_tokens == 8


def test_decoded_tokens_become_shareable() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", range(6))
    admit(kv, request)
    decode(kv, request, 40)
    decode(kv, request, 41)  # block 1 = [4, 5, 40, 41] is now full
    follow_up = make_request("b", [*range(6), 40, 41, 99])
    blocks, num_cached_tokens = kv.get_computed_blocks(follow_up)
    assert ([block.block_id for block in blocks], num_cached_tokens) == ([0, 1], 8)


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", range(10))
    admit(kv, request)
    kv.free(request)
    assert kv.reset_prefix_cache() == 2
    assert kv.get_computed_blocks(make_request("b", range(10))) == ([], 0)


def test_misuse_raises() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", range(10))
    admit(kv, request)
    with pytest.raises(ValueError, match="already has KV"):
        kv.get_computed_blocks(request)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 1, got 0"):
        kv.allocate_slots(request, 0)
    other = make_request("b", range(10))
    blocks, _ = kv.get_computed_blocks(other)
    other.num_computed_tokens = 4
    with pytest.raises(ValueError, match="only accepted for a request that holds no blocks"):
        kv.allocate_slots(other, 1, blocks)
