"""Tables that share blocks and tables cut short: forks, copy-on-write and truncation (rewind)."""

from __future__ import annotations

from pagedserve.scheduler.block_pool import Block, BlockPool
from pagedserve.scheduler.block_tables import BlockTables
from pagedserve.scheduler.kv_groups import first_live_block
from pagedserve.scheduler.kv_stats import KVCacheStats
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.utils import cdiv


class KVForks:
    """The KV manager's part for shared blocks (a part of `KVCacheManager`).

    A fork shares every block, the partial last one included, through ref counts. A shared
    block is never written in place: the request about to write into one gets a copy first
    (`copy_on_write`, which `SlotAllocator.allocate_slots` calls), and the copies to make are
    collected for the runner until `take_copies`.
    """

    def __init__(self, block_pool: BlockPool, tables: BlockTables, stats: KVCacheStats) -> None:
        self.block_pool = block_pool
        self.tables = tables
        self.stats = stats
        # Copy-on-write since the last take_copies(): (request id, table index, source block
        # id, destination block id), in the order the copies were decided.
        self._copies: list[tuple[str, int, int, int]] = []

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Give `child` the parent's blocks that hold its first `num_tokens` tokens, which the
        child's tokens must equal: ref counts go up, nothing is copied. The child has computed
        those tokens; the first of the two to write into a block both hold (the partial last
        one) gets a copy of it (`copy_on_write`)."""
        tables = self.tables
        child_id = child.request_id
        if child_id in tables:
            raise ValueError(f"fork: request {child_id!r} already holds blocks")
        parent_table = tables.get(parent.request_id) or []
        num_entries = cdiv(num_tokens, tables.block_size) * tables.num_groups
        if not 0 < num_entries <= len(parent_table):
            raise ValueError(
                f"fork: request {parent.request_id!r} holds "
                f"{len(parent_table) // tables.num_groups} blocks, which cannot hold "
                f"{num_tokens} tokens to share"
            )
        self.block_pool.touch(block for block in parent_table[:num_entries] if block is not None)
        tables.share(parent.request_id, child_id, num_tokens)

    def truncate(self, request: Request, num_tokens: int) -> int | None:
        """Keep the blocks holding the request's first `num_tokens` tokens and free the rest
        (rewind). A kept block that is now partly past the end and held by this request alone
        leaves the prefix cache, since the request will write its tail again.

        Returns the tokens whose KV is kept, `num_tokens`, or None when every block must go
        (the caller frees the request, which is then computed again from the start):
        `num_tokens` is 0, or a sliding group already gave back blocks the window at
        `num_tokens` needs."""
        tables = self.tables
        request_id = request.request_id
        table = tables.get(request_id)
        if not table:
            return num_tokens
        size, num_groups = tables.block_size, tables.num_groups
        num_kept = cdiv(num_tokens, size)
        if any(
            table[i * num_groups + g] is None
            for g, window in tables.sliding
            for i in range(first_live_block(window, num_tokens, size), num_kept)
        ):
            return None
        if num_kept == 0:
            return None
        self.block_pool.free(reversed(tables.cut(request_id, num_tokens)))
        # The last kept block, now partly past the end: the request will write its tail again,
        # so where it holds the block alone the block leaves the prefix cache.
        if num_kept > num_tokens // size:
            for block in table[(num_kept - 1) * num_groups :]:
                if block is not None and block.ref_cnt == 1:
                    self.block_pool.uncache(block)
        return num_tokens

    def copy_on_write(self, request_id: str, index: int) -> None:
        """Replace the shared block at `index` of the request's table by a fresh one the runner
        fills with a copy (the caller checked that one is free)."""
        (copy,) = self.block_pool.allocate(1)
        source: Block = self.tables.get(request_id)[index]
        self.block_pool.free([source])
        self.tables.replace(request_id, index, copy)
        self._copies.append((request_id, index, source.block_id, copy.block_id))
        self.stats.num_block_copies += 1

    def take_copies(self) -> list[tuple[str, int, int, int]]:
        """The copies decided since the last call, oldest first (`KVCacheManager.take_block_copies`
        says what the runner does with them)."""
        copies, self._copies = self._copies, []
        return copies

    def drop_copies(self, request_id: str) -> None:
        """Forget the copies into the request's blocks (it no longer holds them: a copy into
        them is not to be made)."""
        if self._copies:
            self._copies = [c for c in self._copies if c[0] != request_id]
