"""KV-cache groups: how layers of different attention kinds are grouped, how many blocks a
request holds, and the block manager with sliding-window groups (blocks given back as the window
moves on, prefix-cache hits that need the window's blocks, fork, rewind, free)."""

from __future__ import annotations

import pytest

from pagedserve.scheduler import SamplingParams
from pagedserve.scheduler.kv_cache_manager import DROPPED_BLOCK_ID, KVCacheManager
from pagedserve.scheduler.kv_groups import (
    KVCacheGroup,
    blocks_per_request,
    first_live_block,
    group_layers,
    layers_per_block,
)
from pagedserve.scheduler.request import Request

BLOCK = 4
WINDOW = 8


def _request(request_id: str, num_tokens: int, first: int = 0) -> Request:
    return Request(
        request_id, list(range(first, first + num_tokens)), SamplingParams(max_tokens=64)
    )


def test_groups_of_a_gemma3_pattern_are_single_layers():
    # Gemma 3's pattern: five sliding layers, then a full one.
    windows = [WINDOW] * 5 + [None]
    groups = group_layers(windows)
    assert groups == (KVCacheGroup(None, (5,)),) + tuple(
        KVCacheGroup(WINDOW, (i,)) for i in range(5)
    )
    assert layers_per_block(groups) == 1


def test_groups_of_alternating_layers_and_of_uneven_counts():
    gemma2 = group_layers([WINDOW, None] * 3)
    assert gemma2 == (KVCacheGroup(None, (1, 3, 5)), KVCacheGroup(WINDOW, (0, 2, 4)))
    # Gemma 3 27B: 10 full and 52 sliding layers -> one full group and six sliding ones of 10,
    # the last with 2.
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(62)]
    groups = group_layers(windows)
    assert [(g.window, len(g.layers)) for g in groups] == [(None, 10)] + [(1024, 10)] * 5 + [
        (1024, 2)
    ]
    assert sorted(layer for g in groups for layer in g.layers) == list(range(62))
    assert layers_per_block(groups) == 10


def test_one_kind_of_layer_is_one_group():
    assert group_layers([None] * 4) == (KVCacheGroup(None, (0, 1, 2, 3)),)
    assert group_layers([WINDOW] * 3) == (KVCacheGroup(WINDOW, (0, 1, 2)),)
    with pytest.raises(ValueError, match="at least one layer"):
        group_layers([])


def test_blocks_a_request_holds():
    # Full attention: all of them. A window of 8 with 1-token chunks: positions p-7 .. p span at
    # most 3 blocks of 4; with a 16-token chunk, 8 - 1 + 16 = 23 positions span at most 7.
    assert blocks_per_request((None,), 100, BLOCK, 1) == 25
    assert blocks_per_request((WINDOW,), 100, BLOCK, 1) == 3
    assert blocks_per_request((WINDOW,), 100, BLOCK, 16) == 7
    assert blocks_per_request((None, WINDOW, WINDOW), 100, BLOCK, 1) == 25 + 3 + 3
    assert blocks_per_request((WINDOW,), 5, BLOCK, 16) == 2  # never more than the tokens need
    assert first_live_block(WINDOW, 20, BLOCK) == 3  # position 20 sees 13..20
    assert first_live_block(None, 20, BLOCK) == 0


def _grow(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Decode `num_tokens` more tokens one step at a time (as the scheduler would)."""
    for _ in range(num_tokens):
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        request.append_output_token_ids(7)


def test_a_sliding_group_gives_back_blocks_outside_its_window():
    kv = KVCacheManager(64, BLOCK, windows=(None, WINDOW))
    request = _request("a", 6)
    ids = kv.allocate_slots(request, 6)
    assert ids == list(range(4))  # 2 blocks x 2 groups, interleaved
    request.num_computed_tokens = 6
    _grow(kv, request, 40)  # to 46 tokens: 12 blocks per group
    held = kv.ref_counts("a")
    full, sliding = held[0::2], held[1::2]
    assert full == [1] * 12
    # The next token (position 45) sees 38..45: blocks 9, 10, 11 of the sliding group.
    assert sliding == [0] * 9 + [1] * 3
    assert kv.num_used_blocks == 15 == kv.num_held_blocks("a")
    assert kv.get_block_ids("a")[1:18:2] == [DROPPED_BLOCK_ID] * 9
    kv.free(request)
    assert kv.num_used_blocks == 0


def test_a_prefix_hit_needs_the_window_blocks_of_every_sliding_group():
    kv = KVCacheManager(64, BLOCK, windows=(None, WINDOW))
    first = _request("a", 20)
    kv.allocate_slots(first, 20)
    first.num_computed_tokens = 20
    kv.free(first)  # every block free but still cached
    second = _request("b", 22)  # the same 20 tokens, then two more
    blocks, num_tokens = kv.get_computed_blocks(second)
    # 5 full blocks hit; a chunk from position 20 sees 13..: sliding blocks 3 and 4 only.
    assert num_tokens == 20
    assert [b is not None for b in blocks[0::2]] == [True] * 5
    assert [b is not None for b in blocks[1::2]] == [False] * 3 + [True] * 2
    assert kv.allocate_slots(second, 2, blocks) is not None
    assert kv.num_held_blocks("b") == 5 + 2 + 2  # and the new sixth block in both groups
    kv.free(second)

    # Evict one window block of the sliding group: the hit shrinks to where the window's blocks
    # are all cached again.
    kv.reset_prefix_cache()
    third = _request("c", 20)
    kv.allocate_slots(third, 20)
    third.num_computed_tokens = 20
    kv.free(third)
    cached = [b for b in kv.block_pool.blocks if b.block_hash is not None]
    assert len(cached) == 10
    victim = max(cached, key=lambda b: b.block_id)  # block 9: group 1's block 4
    kv.block_pool.uncache(victim)
    blocks, num_tokens = kv.get_computed_blocks(_request("d", 22))
    # At 16 tokens the window needs sliding blocks 2 and 3, both cached.
    assert num_tokens == 16
    assert [b is not None for b in blocks[1::2]] == [False, False, True, True]


def test_fork_shares_the_dropped_state_and_truncate_past_the_window_recomputes():
    kv = KVCacheManager(64, BLOCK, windows=(None, WINDOW))
    parent = _request("p", 6)
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    _grow(kv, parent, 20)  # 26 tokens, sliding blocks 0..3 dropped
    child = _request("c", 26)
    kv.fork(parent, child, 26)
    assert kv.get_block_ids("c") == kv.get_block_ids("p")
    assert [r == 2 for r in kv.ref_counts("c")[1::2]] == [False] * 4 + [True] * 3
    kv.free(child)
    # Rewinding within the window keeps the blocks; rewinding to where the window needs
    # dropped blocks frees everything, for a recompute from the start.
    assert kv.truncate(parent, 24) == 24
    assert kv.num_held_blocks("p") == 6 + 2  # sliding blocks 4 and 5 (positions 16..23)
    assert kv.truncate(parent, 10) == 0
    assert kv.num_used_blocks == 0


def test_a_full_pool_refuses_without_changing_the_table():
    kv = KVCacheManager(5, BLOCK, windows=(None, WINDOW))
    request = _request("a", 8)
    assert kv.allocate_slots(request, 8) == [0, 1, 2, 3]
    request.num_computed_tokens = 8
    # A ninth token needs a block in both groups; one is free.
    assert kv.allocate_slots(request, 1) is None
    assert kv.get_block_ids("a") == [0, 1, 2, 3]


def test_windows_must_be_positive():
    with pytest.raises(ValueError, match="windows must be"):
        KVCacheManager(8, BLOCK, windows=(0,))
