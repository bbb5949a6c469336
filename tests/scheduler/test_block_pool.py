from __future__ import annotations

import pytest

from pagedserve.scheduler import BlockPool
from pagedserve.scheduler.block_hash import BlockHash, hash_block_tokens


def ids(blocks: list) -> list[int]:
    return [block.block_id for block in blocks]


def test_fresh_pool_hands_out_blocks_in_order() -> None:
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4, 5]
    first = pool.allocate(2)
    second = pool.allocate(3)
    assert ids(first) == [0, 1]
    assert ids(second) == [2, 3, 4]
    assert [block.ref_cnt for block in pool.blocks] == [1, 1, 1, 1, 1, 0]
    assert pool.free_block_ids() == [5]
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(5 / 6)


def test_free_appends_to_tail_in_given_order_and_allocation_pops_head() -> None:
    pool = BlockPool(num_blocks=6, block_size=4)
    blocks = pool.allocate(4)  # 0 1 2 3
    pool.free(reversed(blocks[:3]))  # a request's table, freed tail first
    assert pool.free_block_ids() == [4, 5, 2, 1, 0]
    assert ids(pool.allocate(3)) == [4, 5, 2]
    assert pool.free_block_ids() == [1, 0]


def test_zero_block_allocation_is_empty() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    assert pool.allocate(0) == []
    assert pool.free_block_ids() == [0, 1]


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    pool.allocate(2)
    with pytest.raises(ValueError, match="cannot allocate 2 blocks: only 1 are free"):
        pool.allocate(2)
    assert pool.free_block_ids() == [2]


def test_shared_block_returns_to_free_list_only_at_ref_cnt_zero() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    block = pool.allocate(1)[0]
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1
    assert pool.free_block_ids() == [1, 2, 3]
    pool.free([block])
    assert block.ref_cnt == 0
    assert pool.free_block_ids() == [1, 2, 3, 0]


def test_double_free_raises() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    block = pool.allocate(1)[0]
    pool.free([block])
    with pytest.raises(ValueError, match="double free of block 0"):
        pool.free([block])


def test_touch_revives_a_free_block_from_the_middle_of_the_free_list() -> None:
    pool = BlockPool(num_blocks=5, block_size=4)
    pool.free(pool.allocate(5))  # free list: 0 1 2 3 4
    pool.touch([pool.blocks[2]])
    assert pool.blocks[2].ref_cnt == 1
    assert pool.free_block_ids() == [0, 1, 3, 4]
    assert pool.num_free_blocks == 4


def test_cached_block_survives_free_until_popped_for_reuse() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    block_hash = hash_block_tokens(None, [7, 8])
    block = pool.allocate(1)[0]
    assert pool.cache_full_block(block, block_hash)
    assert pool.get_cached_block(block_hash) is block
    pool.free([block])
    # Lazy eviction: still findable while it sits in the free list.
    assert block.block_hash == block_hash
    assert pool.get_cached_block(block_hash) is block
    assert pool.num_cached_blocks == 1
    assert ids(pool.allocate(2)) == [1, 2]
    assert pool.get_cached_block(block_hash) is block
    # Block 0 is now at the head: reusing it evicts its hash.
    assert ids(pool.allocate(1)) == [0]
    assert block.block_hash is None
    assert pool.get_cached_block(block_hash) is None
    assert pool.num_cached_blocks == 0


def test_eviction_is_least_recently_freed_first() -> None:
    pool = BlockPool(num_blocks=3, block_size=1)
    blocks = pool.allocate(3)
    hashes = [hash_block_tokens(None, [token]) for token in (10, 11, 12)]
    for block, block_hash in zip(blocks, hashes, strict=True):
        pool.cache_full_block(block, block_hash)
    pool.free([blocks[1]])
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    assert pool.free_block_ids() == [1, 2, 0]
    # Revive block 2 (a prefix-cache hit) and free it again: it becomes most recent.
    pool.touch([pool.get_cached_block(hashes[2])])
    pool.free([blocks[2]])
    assert pool.free_block_ids() == [1, 0, 2]
    assert ids(pool.allocate(1)) == [1]
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[2]) is blocks[2]


def test_first_copy_wins_for_duplicate_content() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    first, second = pool.allocate(2)
    block_hash = hash_block_tokens(None, [1, 2])
    assert pool.cache_full_block(first, block_hash)
    assert not pool.cache_full_block(second, block_hash)
    assert second.block_hash is None
    assert pool.get_cached_block(block_hash) is first


def test_lookup_compares_token_ids_not_only_the_digest() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    block = pool.allocate(1)[0]
    pool.cache_full_block(block, BlockHash(b"same digest", (1, 2)))
    assert pool.get_cached_block(BlockHash(b"same digest", (1, 2))) is block
    assert pool.get_cached_block(BlockHash(b"same digest", (1, 3))) is None


def test_cache_full_block_rejects_partial_and_free_blocks() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    block = pool.allocate(1)[0]
    with pytest.raises(ValueError, match="only full blocks are cached: got 1 token ids"):
        pool.cache_full_block(block, hash_block_tokens(None, [1]))
    with pytest.raises(ValueError, match="cannot cache free block 1"):
        pool.cache_full_block(pool.blocks[1], hash_block_tokens(None, [1, 2]))


def test_prefix_caching_disabled_hashes_nothing() -> None:
    pool = BlockPool(num_blocks=2, block_size=2, enable_prefix_caching=False)
    block = pool.allocate(1)[0]
    block_hash = hash_block_tokens(None, [1, 2])
    assert not pool.cache_full_block(block, block_hash)
    assert block.block_hash is None
    assert pool.get_cached_block(block_hash) is None


def test_reset_prefix_cache_forgets_all_hashes() -> None:
    pool = BlockPool(num_blocks=3, block_size=1)
    blocks = pool.allocate(2)
    for token, block in enumerate(blocks):
        pool.cache_full_block(block, hash_block_tokens(None, [token]))
    pool.free([blocks[0]])
    assert pool.reset_prefix_cache() == 2
    assert [block.block_hash for block in pool.blocks] == [None, None, None]
    assert pool.get_cached_block(hash_block_tokens(None, [0])) is None
    assert pool.free_block_ids() == [2, 0]


def test_hash_chain_depends_on_parent_and_tokens() -> None:
    root = hash_block_tokens(None, [1, 2])
    assert root == hash_block_tokens(None, [1, 2])
    assert root.token_ids == (1, 2)
    assert len(root.digest) == 32
    child = hash_block_tokens(root, [3, 4])
    other_parent = hash_block_tokens(hash_block_tokens(None, [9, 9]), [3, 4])
    assert child.token_ids == other_parent.token_ids
    assert child.digest != other_parent.digest
    assert child != other_parent


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0)])
def test_invalid_pool_size(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        BlockPool(num_blocks, block_size)
