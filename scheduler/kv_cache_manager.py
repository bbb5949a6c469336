"""Block tables per request on top of the BlockPool; the scheduler's only view of KV memory."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.scheduler.block_pool import Block, BlockPool
from pagedserve.scheduler.block_tables import DROPPED_BLOCK_ID, BlockTables
from pagedserve.scheduler.kv_allocator import SlotAllocator
from pagedserve.scheduler.kv_encoder import EncoderBlocks
from pagedserve.scheduler.kv_forks import KVForks
from pagedserve.scheduler.kv_stats import KVCacheStats
from pagedserve.scheduler.kv_swap import KVSwap
from pagedserve.scheduler.request import Request

__all__ = ["DROPPED_BLOCK_ID", "KVCacheManager"]


class _Stat:
    """A KVCacheManager attribute that reads the counter of its name in the manager's `stats`
    (scheduler/kv_stats.py, where the parts count)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, kv: KVCacheManager, owner: type | None = None) -> int:
        return getattr(kv.stats, self.name)


class KVCacheManager:
    """Facade over BlockPool: the scheduler speaks in requests and token counts, not blocks.

    A request's block table maps token positions to KV slots::

        position p  ->  block_table[p // block_size], offset p % block_size
        slot        =   block_id * block_size + offset

    Invariants:
    - A table holds at least ceil(n / block_size) blocks per KV-cache group, n being the number
      of tokens the request has been granted slots for (computed or being computed this step);
      exactly that many except after speculative drafts were rejected (their blocks stay for
      later tokens). With G groups (`windows`, one per group; scheduler/kv_groups.py) a table
      interleaves them: entry i * G + g is block i of group g. With one group (every layer
      attends alike) that is the plain table.
    - A sliding-window group's entries before the window of the request's next chunk are None:
      their blocks went back to the pool (`allocate_slots` drops them as the window moves on;
      the full-attention groups keep every block). Dropped blocks keep their prefix-cache hash
      while they sit in the free list, so a later prompt with the same prefix still finds
      them.
    - Blocks are shared through ref counts: full blocks by prefix-cache hits, and any block,
      the partial last one included, by `fork` (the samples of one prompt, beams). A shared
      block is never written in place: the request about to write into one gets a copy first
      (copy-on-write in `allocate_slots`; the copies to make are collected for the runner by
      `take_block_copies`). Only the block holding a request's next position can be one it
      shares and writes: the blocks after it in its table are its own.
    - Blocks are cached as soon as they are allocated full of known tokens, i.e. possibly
      while their KV is still being computed in the current step. The runner must therefore
      write the KV of every scheduled token of a step before attention reads the cache (the
      usual per-layer "write all, then attend"), and must execute a SchedulerOutput as given,
      even for requests aborted after schedule().

    Its parts, each in a file of its own and each given what it needs here: the tables and
    what follows them (scheduler/block_tables.py, the one owner of per-request state),
    allocation and the prefix cache (kv_allocator.py), forks and copy-on-write (kv_forks.py),
    the host pool of swap preemption (kv_swap.py), encoder blocks (kv_encoder.py), and the
    counters they add to (kv_stats.py, shown here under their own names). This class owns the
    pool and composes what spans parts (freeing a request, swapping in).
    """

    num_prefix_cache_queries_tokens = _Stat()
    num_prefix_cache_hits_tokens = _Stat()
    num_block_copies = _Stat()
    num_swapped_out_blocks = _Stat()
    num_swapped_in_blocks = _Stat()

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: tuple[int | None, ...] = (None,),
        num_host_blocks: int = 0,
    ) -> None:
        self._tables = BlockTables(block_size, windows)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = windows
        self.num_groups = self._tables.num_groups
        self.block_pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.stats = KVCacheStats()
        self._forks = KVForks(self.block_pool, self._tables, self.stats)
        self._allocator = SlotAllocator(
            self.block_pool, self._tables, self._forks, self.stats, enable_prefix_caching
        )
        self._swap = KVSwap(self.block_pool, self._tables, self.stats, num_host_blocks)
        # Swap preemption's pool, in host memory, for the KV of preempted requests (None: none).
        self.host_pool = self._swap.host_pool
        self._encoder = EncoderBlocks(self.block_pool)

    # ----------------------------------------------------------------- capacity / stats

    @property
    def num_total_blocks(self) -> int:
        """Size of the pool."""
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, including cached-but-free (evictable) ones."""
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref_cnt > 0."""
        return self.block_pool.num_blocks - self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (empty if it holds none); interleaved by
        group, DROPPED_BLOCK_ID for dropped entries."""
        return list(self._tables.ids(request_id))

    def table_entries(self, request_id: str) -> list[int | None]:
        """The request's block table with None for dropped entries (the live block map's view:
        get_block_ids shows them as DROPPED_BLOCK_ID, itself a real block id)."""
        return [None if b is None else b.block_id for b in self._tables.get(request_id) or ()]

    def ref_counts(self, request_id: str) -> list[int]:
        """The ref count of each block of the request's table, 0 for dropped entries (for tests
        and debugging)."""
        return [0 if b is None else b.ref_cnt for b in self._tables.get(request_id) or ()]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks in the request's table that it holds (dropped entries not counted)."""
        return sum(b is not None for b in self._tables.get(request_id) or ())

    def take_block_copies(self) -> list[tuple[str, int, int, int]]:
        """The copy-on-write copies decided since the last call, oldest first, as (request id,
        table index, source block id, destination block id); the runner copies each source
        block into its destination before the step that writes it runs."""
        return self._forks.take_copies()

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache entry; returns the number dropped."""
        return self.block_pool.reset_prefix_cache()

    def block_owners(self) -> dict[int, list[str]]:
        """Block id -> the requests whose tables hold it (blocks in use only)."""
        owners: dict[int, list[str]] = {}
        for request_id, table in [*self._tables.items(), *self._encoder.items()]:
            for block in table:
                if block is not None:
                    owners.setdefault(block.block_id, []).append(request_id)
        return owners

    def num_unused_slots(self, request: Request) -> int:
        """Slots the request's table holds past its tokens: the unused tail of its last block
        in each group (more after rejected speculative drafts). Fragmentation, in tokens."""
        table = self._tables.get(request.request_id)
        if not table:
            return 0
        capacity = len(table) // self.num_groups * self.block_size
        num_tokens = min(request.num_computed_tokens, capacity)
        return (capacity - num_tokens) * self.num_groups

    # ------------------------------------------------------------------- allocation

    def get_computed_blocks(self, request: Request) -> tuple[list[Block | None], int]:
        """Longest cached prefix of a request that holds no blocks, as (blocks, tokens), for
        `allocate_slots` (SlotAllocator.get_computed_blocks)."""
        return self._allocator.get_computed_blocks(request)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[Block | None] = (),
    ) -> list[int] | None:
        """Grant KV slots for `num_new_tokens` tokens after the request's computed ones; the
        new block ids, or None when the pool cannot (SlotAllocator.allocate_slots)."""
        return self._allocator.allocate_slots(request, num_new_tokens, new_computed_blocks)

    def allocate_encoder_blocks(self, request: Request, num_blocks: int) -> bool:
        """Give an admitted encoder-decoder request its cross-attention blocks; False, changing
        nothing, when the pool has too few free."""
        return self._encoder.allocate(request, num_blocks)

    def encoder_block_ids(self, request_id: str) -> list[int]:
        """The request's cross-attention blocks (empty when it holds none)."""
        return self._encoder.block_ids(request_id)

    def free(self, request: Request) -> None:
        """Release the request's blocks and forget its table; a no-op if it holds none.

        The table is freed in reverse so that its tail blocks reach the free-list head side
        first and are evicted before its (more shareable) leading blocks.
        """
        request_id = request.request_id
        self._swap.drop_swapped(request)
        table = self._tables.remove(request_id)
        self._forks.drop_copies(request_id)
        if table:
            self.block_pool.free(block for block in reversed(table) if block is not None)
        self._encoder.free(request_id)

    def free_untrusted(self, request: Request) -> list[int]:
        """Free the blocks of a request whose KV must not be reused (its step produced NaN or
        inf): those no other request holds also leave the prefix cache. Returns their ids, for
        the caller to clear before the pool hands them out again."""
        table = self._tables.get(request.request_id) or ()
        owned = [block for block in table if block is not None and block.ref_cnt == 1]
        for block in owned:
            self.block_pool.uncache(block)
        self.free(request)
        return [block.block_id for block in owned]

    # ------------------------------------------------------------ forks and rewind

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Share the parent's blocks of the child's first `num_tokens` tokens (KVForks.fork)."""
        self._forks.fork(parent, child, num_tokens)

    def truncate(self, request: Request, num_tokens: int) -> int:
        """Keep the blocks of the request's first `num_tokens` tokens, free the rest (rewind);
        returns the tokens whose KV is kept, `num_tokens` or 0 (KVForks.truncate)."""
        num_kept = self._forks.truncate(request, num_tokens)
        if num_kept is None:
            self.free(request)
            return 0
        return num_kept

    # ------------------------------------------------------------------------- swap

    def is_swapped(self, request_id: str) -> bool:
        """True while the request's KV sits in the host pool."""
        return self._swap.is_swapped(request_id)

    @property
    def num_swapped_blocks(self) -> int:
        """Host-pool blocks holding swapped-out KV."""
        return self._swap.num_swapped_blocks

    def swapped_block_count(self, request_id: str) -> int:
        """Host-pool blocks the request holds (0 when it is not swapped)."""
        return self._swap.swapped_block_count(request_id)

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host pool; the (device, host) block copies, or None
        when it cannot (KVSwap.swap_out), as for a request holding encoder blocks: the caller
        then recomputes it, its encoder pass included."""
        if self._encoder.holds(request.request_id):
            return None
        copies = self._swap.swap_out(request)
        if copies is not None:
            self._forks.drop_copies(request.request_id)
        return copies

    def num_swap_in_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Device blocks `swap_in` and then `allocate_slots(request, num_new_tokens)` take."""
        return self._swap.num_swap_in_blocks(request, num_new_tokens)

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Move a swapped request's blocks back to the device; the (host, device) block copies
        (KVSwap.swap_in)."""
        copies = self._swap.swap_in(request)
        # The fresh blocks carry no hashes: offer them to the prefix cache again (a prefix
        # another block holds by now stays with that one).
        self._allocator.cache_full_blocks(
            request, min(request.num_computed_tokens, request.num_tokens)
        )
        return copies

    def drop_swapped(self, request: Request) -> bool:
        """Forget a swapped request's host blocks (it finished, or will be recomputed);
        returns whether it had any."""
        return self._swap.drop_swapped(request)
