"""Block tables per request on top of the BlockPool; the scheduler's only view of KV memory."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.block_hash import BlockHash, hash_block_tokens
from scheduler.block_pool import Block, BlockPool
from scheduler.request import Request
from scheduler.utils import cdiv


class KVCacheManager:
    """Facade over BlockPool: the scheduler speaks in requests and token counts, not blocks.

    A request's block table maps token positions to KV slots::

        position p  ->  block_table[p // block_size], offset p % block_size
        slot        =   block_id * block_size + offset

    Invariants:
    - A table holds at least ceil(n / block_size) blocks, n being the number of tokens the
      request has been granted slots for (computed or being computed this step); exactly that
      many except after speculative drafts were rejected (their blocks stay for later tokens).
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
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self._tables: dict[str, list[Block]] = {}
        # The same tables as block ids, kept next to them: a decode step reads every running
        # request's table, and rebuilding the id lists from Block objects would cost per-request
        # Python on every step.
        self._table_ids: dict[str, list[int]] = {}
        # Per request: chained hashes of its full blocks, computed once (tokens are
        # append-only, so they stay valid), and how many table entries were offered to the
        # cache already.
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Copy-on-write since the last take_block_copies(): (request id, table index, source
        # block id, destination block id), in the order the copies were decided.
        self._block_copies: list[tuple[str, int, int, int]] = []
        self.num_block_copies = 0  # copy-on-write copies so far
        # Prefix-cache statistics, in tokens, counted once per admission.
        self.num_prefix_cache_queries_tokens = 0
        self.num_prefix_cache_hits_tokens = 0

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
        """The request's block table as block ids (empty if it holds none)."""
        return list(self._table_ids.get(request_id, ()))

    def ref_counts(self, request_id: str) -> list[int]:
        """The ref count of each block of the request's table (for tests and debugging)."""
        return [block.ref_cnt for block in self._tables.get(request_id, ())]

    def take_block_copies(self) -> list[tuple[str, int, int, int]]:
        """The copy-on-write copies decided since the last call, oldest first, as (request id,
        table index, source block id, destination block id); the runner copies each source
        block into its destination before the step that writes it runs."""
        copies, self._block_copies = self._block_copies, []
        return copies

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache entry; returns the number dropped."""
        return self.block_pool.reset_prefix_cache()

    # ------------------------------------------------------------------- allocation

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of `request.all_token_ids`, in whole blocks.

        Returns (blocks, num_computed_tokens). Only for a request that holds no blocks.
        The hit never covers the last token: its logits must be computed to sample from, so
        at most floor((num_tokens - 1) / block_size) blocks are returned. The blocks are not
        referenced yet; pass them to `allocate_slots`.
        """
        if request.request_id in self._tables or request.num_computed_tokens:
            raise ValueError(
                f"get_computed_blocks({request.request_id!r}): request already has KV "
                f"(num_computed_tokens={request.num_computed_tokens})"
            )
        if not self.enable_prefix_caching:
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[Block] = []
        for block_hash in self._hashes_of(request, max_num_blocks):
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                # Stop at the first miss: a later block's KV depends on every token before it.
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[Block] = ()
    ) -> list[int] | None:
        """Grant KV slots for `num_new_tokens` tokens after the request's computed ones.

        The computed prefix is `request.num_computed_tokens` tokens plus, for a request
        being admitted, the prefix-cache hit `new_computed_blocks` from get_computed_blocks.
        Returns the ids of the newly allocated blocks (possibly empty), or None, changing
        nothing, when the pool cannot supply them.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        request_id = request.request_id
        table = self._tables.get(request_id)
        num_total_tokens = request.num_computed_tokens + num_new_tokens
        # The block holding the next position, when the table has it and shares it: written
        # only after a copy-on-write.
        written = request.num_computed_tokens // self.block_size
        shared = table is not None and written < len(table) and table[written].ref_cnt > 1
        if (
            table is not None
            and not new_computed_blocks
            and not shared
            and num_total_tokens <= len(table) * self.block_size
        ):
            # Most decode steps: the slots are in the last block already, and no block filled up
            # (checked here rather than in _cache_full_blocks: this runs per request per step).
            if self.enable_prefix_caching:
                num_known = min(num_total_tokens, len(request.all_token_ids))
                if num_known // self.block_size > self._num_cached_blocks.get(request_id, 0):
                    self._cache_full_blocks(request, table, num_known)
            return []
        if new_computed_blocks and (table or request.num_computed_tokens):
            raise ValueError(
                f"allocate_slots({request_id!r}): prefix-cache blocks are only accepted "
                "for a request that holds no blocks"
            )
        num_computed_tokens = (
            request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        )
        num_total_tokens = num_computed_tokens + num_new_tokens
        num_held_blocks = len(new_computed_blocks) + (len(table) if table else 0)
        num_new_blocks = max(0, cdiv(num_total_tokens, self.block_size) - num_held_blocks)

        # Hit blocks that sit in the free list leave it when touched: they must not be
        # counted as capacity for the fresh blocks of this same call.
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + shared > self.block_pool.num_free_blocks - num_revived:
            return None

        if shared:
            self._copy_on_write(request_id, table, written)

        if table is None:
            table = self._tables[request_id] = []
            self._table_ids[request_id] = []
            self.num_prefix_cache_queries_tokens += request.num_tokens
            self.num_prefix_cache_hits_tokens += len(new_computed_blocks) * self.block_size
        self.block_pool.touch(new_computed_blocks)
        table.extend(new_computed_blocks)
        new_blocks = self.block_pool.allocate(num_new_blocks)
        table.extend(new_blocks)
        new_ids = [block.block_id for block in new_blocks]
        ids = self._table_ids[request_id]
        ids.extend(block.block_id for block in new_computed_blocks)
        ids.extend(new_ids)

        if self.enable_prefix_caching:
            self._cache_full_blocks(request, table, min(num_total_tokens, request.num_tokens))
        return new_ids

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Give `child` the parent's blocks that hold its first `num_tokens` tokens, which the
        child's tokens must equal: ref counts go up, nothing is copied. The child has computed
        those tokens; the first of the two to write into a block both hold (the partial last
        one) gets a copy of it (`allocate_slots`)."""
        child_id = child.request_id
        if child_id in self._tables:
            raise ValueError(f"fork: request {child_id!r} already holds blocks")
        parent_table = self._tables.get(parent.request_id, [])
        num_blocks = cdiv(num_tokens, self.block_size)
        if not 0 < num_blocks <= len(parent_table):
            raise ValueError(
                f"fork: request {parent.request_id!r} holds {len(parent_table)} blocks, "
                f"which cannot hold {num_tokens} tokens to share"
            )
        blocks = parent_table[:num_blocks]
        self.block_pool.touch(blocks)
        self._tables[child_id] = list(blocks)
        self._table_ids[child_id] = self._table_ids[parent.request_id][:num_blocks]
        num_full = num_tokens // self.block_size
        self._block_hashes[child_id] = self._block_hashes.get(parent.request_id, [])[:num_full]
        self._num_cached_blocks[child_id] = min(
            self._num_cached_blocks.get(parent.request_id, 0), num_full
        )

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep the blocks holding the request's first `num_tokens` tokens and free the rest
        (rewind). A kept block that is now partly past the end and held by this request alone
        leaves the prefix cache, since the request will write its tail again."""
        request_id = request.request_id
        table = self._tables.get(request_id)
        if not table:
            return
        num_kept = cdiv(num_tokens, self.block_size)
        if num_kept == 0:
            self.free(request)
            return
        dropped = table[num_kept:]
        del table[num_kept:]
        del self._table_ids[request_id][num_kept:]
        self.block_pool.free(reversed(dropped))
        num_full = num_tokens // self.block_size
        if request_id in self._block_hashes:
            del self._block_hashes[request_id][num_full:]
        if request_id in self._num_cached_blocks:
            self._num_cached_blocks[request_id] = min(self._num_cached_blocks[request_id], num_full)
        if num_kept > num_full and table[-1].ref_cnt == 1:
            self.block_pool.uncache(table[-1])

    def free(self, request: Request) -> None:
        """Release the request's blocks and forget its table; a no-op if it holds none.

        The table is freed in reverse so that its tail blocks reach the free-list head side
        first and are evicted before its (more shareable) leading blocks.
        """
        request_id = request.request_id
        table = self._tables.pop(request_id, None)
        self._table_ids.pop(request_id, None)
        self._block_hashes.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if self._block_copies:  # a copy into a block it no longer holds is not to be made
            self._block_copies = [c for c in self._block_copies if c[0] != request_id]
        if table:
            self.block_pool.free(reversed(table))

    def free_untrusted(self, request: Request) -> list[int]:
        """Free the blocks of a request whose KV must not be reused (its step produced NaN or
        inf): those no other request holds also leave the prefix cache. Returns their ids, for
        the caller to clear before the pool hands them out again."""
        table = self._tables.get(request.request_id, ())
        owned = [block for block in table if block.ref_cnt == 1]
        for block in owned:
            self.block_pool.uncache(block)
        self.free(request)
        return [block.block_id for block in owned]

    # -------------------------------------------------------------------- internals

    def _copy_on_write(self, request_id: str, table: list[Block], index: int) -> None:
        """Replace the shared block `table[index]` by a fresh one the runner fills with a copy
        (the caller checked that one is free)."""
        (copy,) = self.block_pool.allocate(1)
        source = table[index]
        self.block_pool.free([source])
        table[index] = copy
        self._table_ids[request_id][index] = copy.block_id
        self._block_copies.append((request_id, index, source.block_id, copy.block_id))
        self.num_block_copies += 1

    def _hashes_of(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first `num_blocks` full blocks (memoised, extended)."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        token_ids = request.all_token_ids
        size = self.block_size
        while len(hashes) < num_blocks:
            start = len(hashes) * size
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, token_ids[start : start + size]))
        return hashes[:num_blocks]

    def _cache_full_blocks(self, request: Request, table: list[Block], num_known: int) -> None:
        """Offer to the cache every table block that is full of the first `num_known` tokens.

        Only tokens already in all_token_ids can be hashed; slots granted for tokens not yet
        sampled (none today, but speculative decoding would) wait for a later call.
        """
        request_id = request.request_id
        num_full = num_known // self.block_size
        num_done = self._num_cached_blocks.get(request_id, 0)
        if num_full <= num_done:
            return
        hashes = self._hashes_of(request, num_full)
        for index in range(num_done, num_full):
            block = table[index]
            # Prefix-cache hits already carry exactly this hash.
            if block.block_hash is None:
                self.block_pool.cache_full_block(block, hashes[index])
        self._num_cached_blocks[request_id] = num_full
