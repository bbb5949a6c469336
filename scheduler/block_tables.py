"""Every request's block table and what goes with it: the state the KV manager's parts share."""

from __future__ import annotations

from collections.abc import ItemsView, Sequence

from pagedserve.scheduler.block_hash import BlockHash
from pagedserve.scheduler.block_pool import Block
from pagedserve.scheduler.kv_groups import first_live_block
from pagedserve.scheduler.utils import cdiv

# The id a table shows for a sliding-window block given back (never read: the runner points
# such entries at a live block of the row; see engine/worker/input_batch.py).
DROPPED_BLOCK_ID = 0


class BlockTables:
    """The per-request tables of one pool's blocks, and the per-request state that follows a
    table through fork, truncation, swap and free. Holds no blocks itself: whoever takes
    entries out gets them back to free.

    A table interleaves the KV-cache groups (`windows`, one per group; scheduler/kv_groups.py):
    entry i * G + g is block i of group g, None where a sliding group gave the block back. Its
    ids are kept next to it (DROPPED_BLOCK_ID for None): a decode step reads every running
    request's table, and rebuilding the id lists from Block objects would cost per-request
    Python on every step.

    A swapped-out request has no table here but keeps the rest (its drop marks and hashes), so
    that it resumes where it was.
    """

    def __init__(self, block_size: int, windows: tuple[int | None, ...]) -> None:
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must be one None or positive int per group, got {windows}")
        self.block_size = block_size
        self.windows = windows
        self.num_groups = len(windows)
        # (group, window) of each sliding group.
        self.sliding = tuple((g, w) for g, w in enumerate(windows) if w is not None)
        self._tables: dict[str, list[Block | None]] = {}
        # get(request_id): the request's table, None when it holds none; the parts read it and
        # change it only through the methods below. The dict's own get: it runs per request
        # per step.
        self.get = self._tables.get
        self._ids: dict[str, list[int]] = {}
        # Per request with sliding groups, per sliding group: its blocks below this index are
        # dropped already.
        self._num_dropped: dict[str, list[int]] = {}
        # Per request: chained hashes of its full blocks, computed once (tokens are append-only,
        # so they stay valid), and how many table entries were offered to the cache already.
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}
        # num_cached(request_id, 0): how many of the request's blocks (per group) were offered
        # to the prefix cache. The dict's own get as well: a decode step asks for every request.
        self.num_cached = self._num_cached.get

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    def ids(self, request_id: str) -> Sequence[int]:
        """The request's table as block ids (empty if it holds none); not to be changed."""
        return self._ids.get(request_id, ())

    def items(self) -> ItemsView[str, list[Block | None]]:
        """(request id, table) of every request holding one, in the order they got it."""
        return self._tables.items()

    def create(self, request_id: str) -> list[Block | None]:
        """An empty table for a request that holds none, its windows at the start."""
        table: list[Block | None] = []
        self._tables[request_id] = table
        self._ids[request_id] = []
        if self.sliding:
            self._num_dropped[request_id] = [0] * len(self.sliding)
        return table

    def extend(self, request_id: str, blocks: Sequence[Block | None]) -> None:
        """Append entries to the request's table."""
        self._tables[request_id].extend(blocks)
        self._ids[request_id].extend(DROPPED_BLOCK_ID if b is None else b.block_id for b in blocks)

    def replace(self, request_id: str, index: int, block: Block) -> None:
        """Put `block` at `index` of the request's table (its old entry is the caller's)."""
        self._tables[request_id][index] = block
        self._ids[request_id][index] = block.block_id

    def share(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Give the child a copy of the parent's entries and state for its first `num_tokens`
        tokens (the caller takes the references)."""
        num_entries = cdiv(num_tokens, self.block_size) * self.num_groups
        self._tables[child_id] = self._tables[parent_id][:num_entries]
        self._ids[child_id] = self._ids[parent_id][:num_entries]
        if self.sliding:
            self._num_dropped[child_id] = list(self._num_dropped[parent_id])
        num_full = num_tokens // self.block_size
        self._hashes[child_id] = self._hashes.get(parent_id, [])[:num_full]
        self._num_cached[child_id] = min(self._num_cached.get(parent_id, 0), num_full)

    def cut(self, request_id: str, num_tokens: int) -> list[Block]:
        """Keep the entries holding the request's first `num_tokens` tokens (at least one) and
        return the blocks of the others, for the caller to free."""
        table = self._tables[request_id]
        num_kept = cdiv(num_tokens, self.block_size)
        cut = num_kept * self.num_groups
        dropped = [block for block in table[cut:] if block is not None]
        del table[cut:]
        del self._ids[request_id][cut:]
        if request_id in self._num_dropped:
            self._num_dropped[request_id] = [
                min(n, num_kept) for n in self._num_dropped[request_id]
            ]
        num_full = num_tokens // self.block_size
        if request_id in self._hashes:
            del self._hashes[request_id][num_full:]
        if request_id in self._num_cached:
            self._num_cached[request_id] = min(self._num_cached[request_id], num_full)
        return dropped

    def detach(self, request_id: str) -> list[Block | None]:
        """Take the request's table away and keep its state (swap out)."""
        del self._ids[request_id]
        return self._tables.pop(request_id)

    def attach(self, request_id: str, table: list[Block | None]) -> None:
        """Give a detached request its table back, in fresh blocks that carry no hashes yet
        (swap in)."""
        self._tables[request_id] = table
        self._ids[request_id] = [DROPPED_BLOCK_ID if b is None else b.block_id for b in table]
        self._num_cached[request_id] = 0

    def remove(self, request_id: str) -> list[Block | None] | None:
        """Forget the request; returns its table (None if it held none) for the caller to free."""
        self._ids.pop(request_id, None)
        self._num_dropped.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        return self._tables.pop(request_id, None)

    def drop_outside_windows(self, request_id: str, position: int) -> list[Block]:
        """Take out each sliding group's blocks that a chunk starting at `position` no longer
        sees (its window looks back window - 1 positions); returns them for the caller to free."""
        table = self._tables[request_id]
        num_dropped = self._num_dropped[request_id]
        num_blocks = len(table) // self.num_groups
        dropped = []
        for k, (g, window) in enumerate(self.sliding):
            end = min(num_blocks, first_live_block(window, position, self.block_size))
            for i in range(num_dropped[k], end):
                index = i * self.num_groups + g
                if table[index] is not None:
                    dropped.append(table[index])
                    table[index] = None
                    self._ids[request_id][index] = DROPPED_BLOCK_ID
            num_dropped[k] = max(num_dropped[k], end)
        return dropped

    def hashes(self, request_id: str) -> list[BlockHash]:
        """The memo of the request's full blocks' hashes, for the prefix cache to extend."""
        return self._hashes.setdefault(request_id, [])

    def set_num_cached(self, request_id: str, num_blocks: int) -> None:
        """Record that the request's first `num_blocks` blocks (per group) were offered."""
        self._num_cached[request_id] = num_blocks
