"""Granting KV slots: blocks from the pool, reused from the prefix cache and offered to it."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.scheduler.block_hash import BlockHash, group_hash, hash_block_tokens, root_digest
from pagedserve.scheduler.block_pool import Block, BlockPool
from pagedserve.scheduler.block_tables import BlockTables
from pagedserve.scheduler.kv_forks import KVForks
from pagedserve.scheduler.kv_groups import first_live_block
from pagedserve.scheduler.kv_stats import KVCacheStats
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.utils import cdiv


class SlotAllocator:
    """Allocation and the prefix cache (a part of `KVCacheManager`, which documents the
    invariants): grows tables, gives sliding groups' old blocks back, finds cached prefixes and
    caches blocks as they fill. A shared block about to be written goes through `forks`."""

    def __init__(
        self,
        block_pool: BlockPool,
        tables: BlockTables,
        forks: KVForks,
        stats: KVCacheStats,
        enable_prefix_caching: bool,
    ) -> None:
        self.block_pool = block_pool
        self.tables = tables
        self.forks = forks
        self.stats = stats
        self.enable_prefix_caching = enable_prefix_caching

    def get_computed_blocks(self, request: Request) -> tuple[list[Block | None], int]:
        """Longest cached prefix of `request.all_token_ids`, in whole blocks.

        Returns (blocks, num_computed_tokens), blocks interleaved by group as a table is. Only
        for a request that holds no blocks. The hit never covers the last token: its logits
        must be computed to sample from, so at most floor((num_tokens - 1) / block_size) blocks
        per group are returned. A full-attention group needs every block of the prefix cached;
        a sliding group only those its window sees from the end of the prefix (the others
        come back as None). The blocks are not referenced yet; pass them to `allocate_slots`.
        """
        if request.request_id in self.tables or request.num_computed_tokens:
            raise ValueError(
                f"get_computed_blocks({request.request_id!r}): request already has KV "
                f"(num_computed_tokens={request.num_computed_tokens})"
            )
        if not self.enable_prefix_caching:
            return [], 0
        size, windows = self.tables.block_size, self.tables.windows
        hashes = self._hashes_of(request, (request.num_tokens - 1) // size)
        groups = range(self.tables.num_groups)
        cached = self.block_pool.get_cached_block
        full = [g for g in groups if windows[g] is None]
        num_hit = 0
        # Stop at the first miss: a later block's KV depends on every token before it.
        while num_hit < len(hashes) and all(cached(group_hash(hashes[num_hit], g)) for g in full):
            num_hit += 1
        # A sliding group must still hold the blocks its window sees from the end of the hit.
        while num_hit and not all(
            cached(group_hash(hashes[i], g))
            for g, window in self.tables.sliding
            for i in range(first_live_block(window, num_hit * size, size), num_hit)
        ):
            num_hit -= 1
        blocks: list[Block | None] = []
        live = [first_live_block(w, num_hit * size, size) for w in windows]
        for i in range(num_hit):
            for g in groups:
                blocks.append(cached(group_hash(hashes[i], g)) if i >= live[g] else None)
        return blocks, num_hit * size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[Block | None]
    ) -> list[int] | None:
        """Grant KV slots for `num_new_tokens` tokens after the request's computed ones.

        The computed prefix is `request.num_computed_tokens` tokens plus, for a request
        being admitted, the prefix-cache hit `new_computed_blocks` from get_computed_blocks.
        Sliding groups first give back the blocks the chunk no longer sees. Returns the ids
        of the newly allocated blocks (possibly empty; interleaved by group), or None when
        the pool cannot supply them, changing nothing else.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        tables = self.tables
        request_id = request.request_id
        table = tables.get(request_id)
        num_groups, size = tables.num_groups, tables.block_size
        if table is not None and tables.sliding:
            dropped = tables.drop_outside_windows(request_id, request.num_computed_tokens)
            if dropped:
                self.block_pool.free(dropped)
        num_total_tokens = request.num_computed_tokens + num_new_tokens
        # The blocks holding the next position, where the table has them and shares them:
        # written only after a copy-on-write.
        written = request.num_computed_tokens // size * num_groups
        shared = []
        if table is not None:
            for index in range(written, min(written + num_groups, len(table))):
                block = table[index]
                if block is not None and block.ref_cnt > 1:
                    shared.append(index)
        if (
            table is not None
            and not new_computed_blocks
            and not shared
            and num_total_tokens * num_groups <= len(table) * size
        ):
            # Most decode steps: the slots are in the last block already, and no block filled up
            # (checked here rather than in cache_full_blocks: this runs per request per step).
            if self.enable_prefix_caching:
                num_known = min(num_total_tokens, len(request.all_token_ids))
                if num_known // size > tables.num_cached(request_id, 0):
                    self.cache_full_blocks(request, num_known)
            return []
        if new_computed_blocks and (table or request.num_computed_tokens):
            raise ValueError(
                f"allocate_slots({request_id!r}): prefix-cache blocks are only accepted "
                "for a request that holds no blocks"
            )
        num_computed_tokens = (
            request.num_computed_tokens + len(new_computed_blocks) // num_groups * size
        )
        num_total_tokens = num_computed_tokens + num_new_tokens
        num_held = (len(new_computed_blocks) + (len(table) if table else 0)) // num_groups
        num_new_blocks = max(0, cdiv(num_total_tokens, size) - num_held) * num_groups

        # Hit blocks that sit in the free list leave it when touched: they must not be
        # counted as capacity for the fresh blocks of this same call.
        hit = [block for block in new_computed_blocks if block is not None]
        num_revived = sum(1 for block in hit if block.ref_cnt == 0)
        if num_new_blocks + len(shared) > self.block_pool.num_free_blocks - num_revived:
            return None

        for index in shared:
            self.forks.copy_on_write(request_id, index)

        if table is None:
            tables.create(request_id)
            self.stats.num_prefix_cache_queries_tokens += request.num_tokens
            self.stats.num_prefix_cache_hits_tokens += len(new_computed_blocks) // num_groups * size
        self.block_pool.touch(hit)
        tables.extend(request_id, new_computed_blocks)
        new_blocks = self.block_pool.allocate(num_new_blocks)
        tables.extend(request_id, new_blocks)
        self.cache_full_blocks(request, min(num_total_tokens, request.num_tokens))
        return [block.block_id for block in new_blocks]

    def cache_full_blocks(self, request: Request, num_known: int) -> None:
        """Offer to the cache every block of the request's table that is full of its first
        `num_known` tokens (a no-op without prefix caching).

        Only tokens already in all_token_ids can be hashed; slots granted for tokens not yet
        sampled (speculative drafts) wait for a later call. Each group's block of a prefix is
        cached under its own key (`group_hash`).
        """
        if not self.enable_prefix_caching:
            return
        tables = self.tables
        request_id = request.request_id
        num_full = num_known // tables.block_size
        num_done = tables.num_cached(request_id, 0)
        if num_full <= num_done:
            return
        table = tables.get(request_id)
        hashes = self._hashes_of(request, num_full)
        num_groups = tables.num_groups
        for index in range(num_done * num_groups, num_full * num_groups):
            block = table[index]
            # Prefix-cache hits already carry exactly this hash; dropped blocks were cached
            # when they filled.
            if block is not None and block.block_hash is None:
                group, i = index % num_groups, index // num_groups
                parent = group_hash(hashes[i - 1], group) if i else None
                self.block_pool.cache_full_block(
                    block, group_hash(hashes[i], group), parent, request.lora
                )
        tables.set_num_cached(request_id, num_full)

    def _hashes_of(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first `num_blocks` full blocks (memoised, extended)."""
        hashes = self.tables.hashes(request.request_id)
        token_ids = request.all_token_ids
        size = self.tables.block_size
        while len(hashes) < num_blocks:
            start = len(hashes) * size
            parent = hashes[-1] if hashes else None
            root = root_digest(request.lora.lora_int_id if request.lora else 0)
            hashes.append(hash_block_tokens(parent, token_ids[start : start + size], root))
        return hashes[:num_blocks]
