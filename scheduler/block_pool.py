"""Fixed pool of KV-cache blocks: ref counts, an LRU free list and the prefix-cache map."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pagedserve.scheduler.block_hash import BlockHash
from pagedserve.scheduler.kv_events import KVEventLog
from pagedserve.scheduler.lora_request import LoRARequest

# A block's state in the live block map (`BlockPool.block_states`, GET /v1/kv).
BLOCK_FREE, BLOCK_CACHED, BLOCK_USED = 0, 1, 2


class Block:
    """Bookkeeping for one KV block (the KV tensors themselves live in the engine).

    Invariants, kept by BlockPool:
    - `ref_cnt` is the number of block tables holding the block; 0 iff it is in the free list.
    - `block_hash is not None` iff the pool's cache map sends that hash to this block. A free
      block may keep its hash (cached-but-free): it is still findable until reused.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"Block({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class BlockPool:
    """All KV blocks, the free list and (with prefix caching) the hash -> block map.

    Free list order is deterministic and doubles as the eviction order: `allocate` pops
    from the head, `free` pushes to the tail in the order given, so the head holds the least
    recently freed block (LRU). A fresh pool hands out block 0, 1, 2, ...

    Eviction is lazy: a freed full block keeps its hash and can be revived by a prefix-cache
    hit (`touch`, an O(1) removal from the middle of the free list) until `allocate` pops it
    for reuse, which is the moment its hash leaves the cache map.

    The free list is an OrderedDict keyed by block id: O(1) pop from the head, push to the
    tail and removal from the middle.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        # Every change of `_cached`, for KV events (scheduler/kv_events.py); None: not kept.
        self.event_log: KVEventLog | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached-but-free ones included (they are evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, in use or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0), in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_states(self) -> tuple[list[int], list[int], list[bool]]:
        """Per block, by id: its state (BLOCK_FREE, BLOCK_CACHED: free but still findable by
        its prefix hash, BLOCK_USED: ref_cnt > 0), its ref count, and whether it holds a prefix
        hash (in use or not). O(n), for the live block map."""
        refs = [block.ref_cnt for block in self.blocks]
        cached = [block.block_hash is not None for block in self.blocks]
        states = [
            BLOCK_USED if ref else BLOCK_CACHED if hashed else BLOCK_FREE
            for ref, hashed in zip(refs, cached, strict=True)
        ]
        return states, refs, cached

    def free_block_ids(self) -> list[int]:
        """The free list from head (next to allocate) to tail; O(n), for tests and debugging."""
        return list(self._free)

    def allocate(self, num_blocks: int) -> list[Block]:
        """Pop `num_blocks` blocks from the head of the free list, each with ref_cnt 1.

        A popped block that was cached loses its hash (this is the eviction). Raises
        ValueError when fewer blocks are free; callers check `num_free_blocks` first.
        """
        if num_blocks > len(self._free):
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {len(self._free)} are free"
            )
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.event_log is not None:
                    self.event_log.removed(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the free-list tail.

        Blocks are appended in the order given. Callers free a request's table in reverse,
        so its last blocks (the least likely to be shared by another prompt) are evicted
        first and its first blocks (shared system prompts) survive longest.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add one reference to each block, reviving free (cached) ones from the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        """The block holding exactly this prefix, or None (always None without caching)."""
        return self._cached.get(block_hash)

    def cache_full_block(
        self,
        block: Block,
        block_hash: BlockHash,
        parent: BlockHash | None = None,
        lora: LoRARequest | None = None,
    ) -> bool:
        """Make a full, in-use block findable under `block_hash`. `parent` (the key of the
        block before it, None for a first block) and `lora` (the request's adapter) are only
        told to the event log.

        Returns False (and leaves the block uncached) when prefix caching is off or another
        block already holds this content: the first copy wins, so every hash names exactly
        one block and the duplicate is recycled like any unhashed block.
        """
        if block.ref_cnt <= 0:
            raise ValueError(f"cannot cache free block {block.block_id}")
        if len(block_hash.token_ids) != self.block_size:
            raise ValueError(
                f"only full blocks are cached: got {len(block_hash.token_ids)} token ids, "
                f"block_size is {self.block_size}"
            )
        if not self.enable_prefix_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self.event_log is not None:
            self.event_log.stored(block_hash, parent, lora)
        return True

    def uncache(self, block: Block) -> None:
        """Take one block out of the prefix cache (a no-op for an uncached block)."""
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.event_log is not None:
                    self.event_log.removed(block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every hash (in-use blocks just stop being shareable); returns how many."""
        num_dropped = len(self._cached)
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.event_log is not None:
            self.event_log.cleared()
        return num_dropped
