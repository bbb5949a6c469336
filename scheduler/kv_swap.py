"""Swap preemption's KV: a host pool that preempted requests' blocks move to and back from."""

from __future__ import annotations

from pagedserve.scheduler.block_pool import Block, BlockPool
from pagedserve.scheduler.block_tables import BlockTables
from pagedserve.scheduler.kv_stats import KVCacheStats
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.utils import cdiv


class KVSwap:
    """The host pool and the tables of swapped-out requests (a part of `KVCacheManager`).

    Host blocks are never shared and never cached. A swapped request's table here keeps the
    shape of its device table (dropped sliding-window entries as None); its other state stays
    in `BlockTables`, so that it resumes where it was.
    """

    def __init__(
        self, block_pool: BlockPool, tables: BlockTables, stats: KVCacheStats, num_host_blocks: int
    ) -> None:
        self.block_pool = block_pool
        self.tables = tables
        self.stats = stats
        self.host_pool = (
            BlockPool(num_host_blocks, tables.block_size, False) if num_host_blocks else None
        )
        self._swapped: dict[str, list[Block | None]] = {}

    def is_swapped(self, request_id: str) -> bool:
        """True while the request's KV sits in the host pool."""
        return request_id in self._swapped

    @property
    def num_swapped_blocks(self) -> int:
        """Host-pool blocks holding swapped-out KV."""
        host = self.host_pool
        return 0 if host is None else host.num_blocks - host.num_free_blocks

    def swapped_block_count(self, request_id: str) -> int:
        """Host-pool blocks the request holds (0 when it is not swapped)."""
        return sum(block is not None for block in self._swapped.get(request_id, ()))

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host pool: each block it holds gets a host block,
        and its device blocks are freed (a shared one stays with its other holders; a cached one
        keeps its hash in the free list). Returns the (device block id, host block id) copies
        for the runner, or None, changing nothing, when there is no host pool or too few of its
        blocks are free. The caller keeps requests holding encoder blocks out.

        The request keeps its hashes and progress, so `swap_in` resumes it where it was."""
        request_id = request.request_id
        table = self.tables.get(request_id)
        if self.host_pool is None or not table:
            return None
        held = [block for block in table if block is not None]
        if len(held) > self.host_pool.num_free_blocks:
            return None
        host_blocks = iter(self.host_pool.allocate(len(held)))
        host_table: list[Block | None] = [
            None if block is None else next(host_blocks) for block in table
        ]
        copies = [
            (block.block_id, host.block_id)
            for block, host in zip(table, host_table, strict=True)
            if block is not None and host is not None
        ]
        self.tables.detach(request_id)
        self.block_pool.free(reversed(held))
        self._swapped[request_id] = host_table
        self.stats.num_swapped_out_blocks += len(copies)
        return copies

    def num_swap_in_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Device blocks `swap_in` and then `allocate_slots(request, num_new_tokens)` take at
        most (the blocks a sliding window would give back are not subtracted)."""
        host_table = self._swapped[request.request_id]
        held = sum(block is not None for block in host_table)
        total = request.num_computed_tokens + num_new_tokens
        num_groups = self.tables.num_groups
        grow = max(0, cdiv(total, self.tables.block_size) - len(host_table) // num_groups)
        return held + grow * num_groups

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Move a swapped request's blocks back into fresh device blocks (the caller checked
        `num_swap_in_blocks` against the free blocks). Returns the (host block id, device block
        id) copies for the runner; the host blocks are free again. The fresh blocks carry no
        hashes: the caller offers them to the prefix cache."""
        request_id = request.request_id
        host_table = self._swapped.pop(request_id)
        held = [block for block in host_table if block is not None]
        device_blocks = iter(self.block_pool.allocate(len(held)))
        table: list[Block | None] = [
            None if block is None else next(device_blocks) for block in host_table
        ]
        self.tables.attach(request_id, table)
        copies = [
            (host.block_id, block.block_id)
            for host, block in zip(host_table, table, strict=True)
            if host is not None and block is not None
        ]
        self.host_pool.free(reversed(held))
        self.stats.num_swapped_in_blocks += len(copies)
        return copies

    def drop_swapped(self, request: Request) -> bool:
        """Forget a swapped request's host blocks and its state (it finished, or will be
        recomputed); returns whether it had any."""
        host_table = self._swapped.pop(request.request_id, None)
        if host_table is None:
            return False
        self.host_pool.free(reversed([block for block in host_table if block is not None]))
        self.tables.remove(request.request_id)
        return True
