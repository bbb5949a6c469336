"""Block tables per request on top of the BlockPool; the scheduler's only view of KV memory."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.scheduler.block_hash import BlockHash, hash_block_tokens, root_digest
from pagedserve.scheduler.block_pool import Block, BlockPool
from pagedserve.scheduler.kv_groups import first_live_block
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.utils import cdiv

# The id a table shows for a sliding-window block given back (never read: the runner points
# such entries at a live block of the row; see engine/worker/input_batch.py).
DROPPED_BLOCK_ID = 0


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
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: tuple[int | None, ...] = (None,),
        num_host_blocks: int = 0,
    ) -> None:
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must be one None or positive int per group, got {windows}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = windows
        self.num_groups = len(windows)
        self._sliding = tuple((g, w) for g, w in enumerate(windows) if w is not None)
        self.block_pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        # Swap preemption: a second pool, in host memory, for the KV of preempted requests
        # (never shared, never cached). Its tables sit in `_swapped`, dropped entries as None.
        self.host_pool = BlockPool(num_host_blocks, block_size, False) if num_host_blocks else None
        self._swapped: dict[str, list[Block | None]] = {}
        self.num_swapped_out_blocks = 0  # device blocks copied to the host pool so far
        self.num_swapped_in_blocks = 0  # and back
        self._tables: dict[str, list[Block | None]] = {}
        # Per request with sliding groups, per sliding group: its blocks below this index are
        # dropped already.
        self._num_dropped: dict[str, list[int]] = {}
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
        # Encoder-decoder requests' cross-attention blocks: allocated once at admission, never
        # grown, shared or swapped, freed with the request's table.
        self._encoder_blocks: dict[str, list[Block]] = {}

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
        return list(self._table_ids.get(request_id, ()))

    def table_entries(self, request_id: str) -> list[int | None]:
        """The request's block table with None for dropped entries (the live block map's view:
        get_block_ids shows them as DROPPED_BLOCK_ID, itself a real block id)."""
        return [None if b is None else b.block_id for b in self._tables.get(request_id, ())]

    def ref_counts(self, request_id: str) -> list[int]:
        """The ref count of each block of the request's table, 0 for dropped entries (for tests
        and debugging)."""
        return [0 if b is None else b.ref_cnt for b in self._tables.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks in the request's table that it holds (dropped entries not counted)."""
        return sum(b is not None for b in self._tables.get(request_id, ()))

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

    def get_computed_blocks(self, request: Request) -> tuple[list[Block | None], int]:
        """Longest cached prefix of `request.all_token_ids`, in whole blocks.

        Returns (blocks, num_computed_tokens), blocks interleaved by group as a table is. Only
        for a request that holds no blocks. The hit never covers the last token: its logits
        must be computed to sample from, so at most floor((num_tokens - 1) / block_size) blocks
        per group are returned. A full-attention group needs every block of the prefix cached;
        a sliding group only those its window sees from the end of the prefix (the others
        come back as None). The blocks are not referenced yet; pass them to `allocate_slots`.
        """
        if request.request_id in self._tables or request.num_computed_tokens:
            raise ValueError(
                f"get_computed_blocks({request.request_id!r}): request already has KV "
                f"(num_computed_tokens={request.num_computed_tokens})"
            )
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._hashes_of(request, (request.num_tokens - 1) // self.block_size)
        groups = range(self.num_groups)
        cached = self.block_pool.get_cached_block
        full = [g for g in groups if self.windows[g] is None]
        num_hit = 0
        # Stop at the first miss: a later block's KV depends on every token before it.
        while num_hit < len(hashes) and all(cached(_group_hash(hashes[num_hit], g)) for g in full):
            num_hit += 1
        # A sliding group must still hold the blocks its window sees from the end of the hit.
        while num_hit and not all(
            cached(_group_hash(hashes[i], g))
            for g, window in self._sliding
            for i in range(
                first_live_block(window, num_hit * self.block_size, self.block_size), num_hit
            )
        ):
            num_hit -= 1
        blocks: list[Block | None] = []
        live = [
            first_live_block(w, num_hit * self.block_size, self.block_size) for w in self.windows
        ]
        for i in range(num_hit):
            for g in groups:
                blocks.append(cached(_group_hash(hashes[i], g)) if i >= live[g] else None)
        return blocks, num_hit * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[Block | None] = (),
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
        request_id = request.request_id
        table = self._tables.get(request_id)
        num_groups, size = self.num_groups, self.block_size
        if table is not None and self._sliding:
            self._drop_outside_windows(request_id, table, request.num_computed_tokens)
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
            # (checked here rather than in _cache_full_blocks: this runs per request per step).
            if self.enable_prefix_caching:
                num_known = min(num_total_tokens, len(request.all_token_ids))
                if num_known // size > self._num_cached_blocks.get(request_id, 0):
                    self._cache_full_blocks(request, table, num_known)
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
            self._copy_on_write(request_id, table, index)

        if table is None:
            table = self._tables[request_id] = []
            self._table_ids[request_id] = []
            self.num_prefix_cache_queries_tokens += request.num_tokens
            self.num_prefix_cache_hits_tokens += len(new_computed_blocks) // num_groups * size
            if self._sliding:
                self._num_dropped[request_id] = [0] * len(self._sliding)
        self.block_pool.touch(hit)
        table.extend(new_computed_blocks)
        new_blocks = self.block_pool.allocate(num_new_blocks)
        table.extend(new_blocks)
        new_ids = [block.block_id for block in new_blocks]
        ids = self._table_ids[request_id]
        ids.extend(DROPPED_BLOCK_ID if b is None else b.block_id for b in new_computed_blocks)
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
        num_entries = cdiv(num_tokens, self.block_size) * self.num_groups
        if not 0 < num_entries <= len(parent_table):
            raise ValueError(
                f"fork: request {parent.request_id!r} holds "
                f"{len(parent_table) // self.num_groups} blocks, which cannot hold "
                f"{num_tokens} tokens to share"
            )
        blocks = parent_table[:num_entries]
        self.block_pool.touch(block for block in blocks if block is not None)
        self._tables[child_id] = list(blocks)
        self._table_ids[child_id] = self._table_ids[parent.request_id][:num_entries]
        if self._sliding:
            self._num_dropped[child_id] = list(self._num_dropped[parent.request_id])
        num_full = num_tokens // self.block_size
        self._block_hashes[child_id] = self._block_hashes.get(parent.request_id, [])[:num_full]
        self._num_cached_blocks[child_id] = min(
            self._num_cached_blocks.get(parent.request_id, 0), num_full
        )

    def truncate(self, request: Request, num_tokens: int) -> int:
        """Keep the blocks holding the request's first `num_tokens` tokens and free the rest
        (rewind). A kept block that is now partly past the end and held by this request alone
        leaves the prefix cache, since the request will write its tail again.

        Returns the tokens whose KV is kept: `num_tokens`, or 0 (and every block freed) when a
        sliding group already gave back blocks the window at `num_tokens` needs: the request
        is then computed again from the start."""
        request_id = request.request_id
        table = self._tables.get(request_id)
        if not table:
            return num_tokens
        num_kept = cdiv(num_tokens, self.block_size)
        if any(
            table[i * self.num_groups + g] is None
            for g, window in self._sliding
            for i in range(first_live_block(window, num_tokens, self.block_size), num_kept)
        ):
            self.free(request)
            return 0
        if num_kept == 0:
            self.free(request)
            return 0
        cut = num_kept * self.num_groups
        dropped = [block for block in table[cut:] if block is not None]
        del table[cut:]
        del self._table_ids[request_id][cut:]
        self.block_pool.free(reversed(dropped))
        if request_id in self._num_dropped:
            self._num_dropped[request_id] = [
                min(n, num_kept) for n in self._num_dropped[request_id]
            ]
        num_full = num_tokens // self.block_size
        if request_id in self._block_hashes:
            del self._block_hashes[request_id][num_full:]
        if request_id in self._num_cached_blocks:
            self._num_cached_blocks[request_id] = min(self._num_cached_blocks[request_id], num_full)
        if num_kept > num_full:
            for block in table[cut - self.num_groups :]:
                if block is not None and block.ref_cnt == 1:
                    self.block_pool.uncache(block)
        return num_tokens

    def allocate_encoder_blocks(self, request: Request, num_blocks: int) -> bool:
        """Give an admitted encoder-decoder request its cross-attention blocks; False, changing
        nothing, when the pool has too few free."""
        if num_blocks > self.block_pool.num_free_blocks:
            return False
        self._encoder_blocks[request.request_id] = self.block_pool.allocate(num_blocks)
        return True

    def encoder_block_ids(self, request_id: str) -> list[int]:
        """The request's cross-attention blocks (empty when it holds none)."""
        return [block.block_id for block in self._encoder_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        """Release the request's blocks and forget its table; a no-op if it holds none.

        The table is freed in reverse so that its tail blocks reach the free-list head side
        first and are evicted before its (more shareable) leading blocks.
        """
        request_id = request.request_id
        self.drop_swapped(request)
        table = self._tables.pop(request_id, None)
        self._table_ids.pop(request_id, None)
        self._num_dropped.pop(request_id, None)
        self._block_hashes.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if self._block_copies:  # a copy into a block it no longer holds is not to be made
            self._block_copies = [c for c in self._block_copies if c[0] != request_id]
        if table:
            self.block_pool.free(block for block in reversed(table) if block is not None)
        encoder_blocks = self._encoder_blocks.pop(request_id, None)
        if encoder_blocks:
            self.block_pool.free(reversed(encoder_blocks))

    def free_untrusted(self, request: Request) -> list[int]:
        """Free the blocks of a request whose KV must not be reused (its step produced NaN or
        inf): those no other request holds also leave the prefix cache. Returns their ids, for
        the caller to clear before the pool hands them out again."""
        table = self._tables.get(request.request_id, ())
        owned = [block for block in table if block is not None and block.ref_cnt == 1]
        for block in owned:
            self.block_pool.uncache(block)
        self.free(request)
        return [block.block_id for block in owned]

    def block_owners(self) -> dict[int, list[str]]:
        """Block id -> the requests whose tables hold it (blocks in use only)."""
        owners: dict[int, list[str]] = {}
        for request_id, table in [*self._tables.items(), *self._encoder_blocks.items()]:
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

    # ------------------------------------------------------------------------- swap

    def is_swapped(self, request_id: str) -> bool:
        """True while the request's KV sits in the host pool."""
        return request_id in self._swapped

    @property
    def num_swapped_blocks(self) -> int:
        """Host-pool blocks holding swapped-out KV."""
        return (
            0
            if self.host_pool is None
            else self.host_pool.num_blocks - self.host_pool.num_free_blocks
        )

    def swapped_block_count(self, request_id: str) -> int:
        """Host-pool blocks the request holds (0 when it is not swapped)."""
        return sum(block is not None for block in self._swapped.get(request_id, ()))

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host pool: each block it holds gets a host block,
        and its device blocks are freed (a shared one stays with its other holders; a cached one
        keeps its hash in the free list). Returns the (device block id, host block id) copies
        for the runner, or None, changing nothing, when there is no host pool, too few of its
        blocks are free, or the request holds encoder blocks (the caller then recomputes instead,
        an encoder-decoder request its encoder pass included).

        The request keeps its hashes and progress, so `swap_in` resumes it where it was."""
        request_id = request.request_id
        table = self._tables.get(request_id)
        if self.host_pool is None or not table or request_id in self._encoder_blocks:
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
        del self._tables[request_id]
        del self._table_ids[request_id]
        if self._block_copies:
            self._block_copies = [c for c in self._block_copies if c[0] != request_id]
        self.block_pool.free(reversed(held))
        self._swapped[request_id] = host_table
        self.num_swapped_out_blocks += len(copies)
        return copies

    def num_swap_in_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Device blocks `swap_in` and then `allocate_slots(request, num_new_tokens)` take at
        most (the blocks a sliding window would give back are not subtracted)."""
        host_table = self._swapped[request.request_id]
        held = sum(block is not None for block in host_table)
        total = request.num_computed_tokens + num_new_tokens
        grow = max(0, cdiv(total, self.block_size) - len(host_table) // self.num_groups)
        return held + grow * self.num_groups

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Move a swapped request's blocks back into fresh device blocks (the caller checked
        `num_swap_in_blocks` against the free blocks). Returns the (host block id, device block
        id) copies for the runner; the host blocks are free again."""
        request_id = request.request_id
        host_table = self._swapped.pop(request_id)
        held = [block for block in host_table if block is not None]
        device_blocks = iter(self.block_pool.allocate(len(held)))
        table: list[Block | None] = [
            None if block is None else next(device_blocks) for block in host_table
        ]
        self._tables[request_id] = table
        self._table_ids[request_id] = [
            DROPPED_BLOCK_ID if block is None else block.block_id for block in table
        ]
        # The fresh blocks carry no hashes: offer them to the prefix cache again (a prefix
        # another block holds by now stays with that one).
        self._num_cached_blocks[request_id] = 0
        if self.enable_prefix_caching:
            self._cache_full_blocks(
                request, table, min(request.num_computed_tokens, request.num_tokens)
            )
        copies = [
            (host.block_id, block.block_id)
            for host, block in zip(host_table, table, strict=True)
            if host is not None and block is not None
        ]
        self.host_pool.free(reversed(held))
        self.num_swapped_in_blocks += len(copies)
        return copies

    def drop_swapped(self, request: Request) -> bool:
        """Forget a swapped request's host blocks (it finished, or will be recomputed);
        returns whether it had any."""
        host_table = self._swapped.pop(request.request_id, None)
        if host_table is None:
            return False
        self.host_pool.free(reversed([block for block in host_table if block is not None]))
        self._num_dropped.pop(request.request_id, None)
        self._block_hashes.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        return True

    # -------------------------------------------------------------------- internals

    def _drop_outside_windows(
        self, request_id: str, table: list[Block | None], position: int
    ) -> None:
        """Give back each sliding group's blocks that a chunk starting at `position` no longer
        sees (its window looks back window - 1 positions)."""
        num_dropped = self._num_dropped[request_id]
        num_blocks = len(table) // self.num_groups
        dropped = []
        for k, (g, window) in enumerate(self._sliding):
            end = min(num_blocks, first_live_block(window, position, self.block_size))
            for i in range(num_dropped[k], end):
                index = i * self.num_groups + g
                if table[index] is not None:
                    dropped.append(table[index])
                    table[index] = None
                    self._table_ids[request_id][index] = DROPPED_BLOCK_ID
            num_dropped[k] = max(num_dropped[k], end)
        if dropped:
            self.block_pool.free(dropped)

    def _copy_on_write(self, request_id: str, table: list[Block | None], index: int) -> None:
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
            root = root_digest(request.lora.lora_int_id if request.lora else 0)
            hashes.append(hash_block_tokens(parent, token_ids[start : start + size], root))
        return hashes[:num_blocks]

    def _cache_full_blocks(
        self, request: Request, table: list[Block | None], num_known: int
    ) -> None:
        """Offer to the cache every table block that is full of the first `num_known` tokens.

        Only tokens already in all_token_ids can be hashed; slots granted for tokens not yet
        sampled (speculative drafts) wait for a later call. Each group's block of a prefix is
        cached under its own key (`_group_hash`).
        """
        request_id = request.request_id
        num_full = num_known // self.block_size
        num_done = self._num_cached_blocks.get(request_id, 0)
        if num_full <= num_done:
            return
        hashes = self._hashes_of(request, num_full)
        num_groups = self.num_groups
        for index in range(num_done * num_groups, num_full * num_groups):
            block = table[index]
            # Prefix-cache hits already carry exactly this hash; dropped blocks were cached
            # when they filled.
            if block is not None and block.block_hash is None:
                group, i = index % num_groups, index // num_groups
                parent = _group_hash(hashes[i - 1], group) if i else None
                self.block_pool.cache_full_block(
                    block, _group_hash(hashes[i], group), parent, request.lora
                )
        self._num_cached_blocks[request_id] = num_full


def _group_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of group `group`'s block of a prefix: the groups' blocks hold
    different layers' KV of the same tokens, so each gets a key of its own (group 0 the plain
    hash)."""
    if group == 0:
        return block_hash
    return BlockHash(block_hash.digest + group.to_bytes(2, "little"), block_hash.token_ids)
