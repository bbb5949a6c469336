"""Encoder-decoder requests' cross-attention blocks (Whisper): one more kind of KV per request."""

from __future__ import annotations

from collections.abc import ItemsView

from pagedserve.scheduler.block_pool import Block, BlockPool
from pagedserve.scheduler.request import Request


class EncoderBlocks:
    """Cross-attention blocks per request (a part of `KVCacheManager`): allocated once at
    admission, never grown, shared or swapped, freed with the request's table."""

    def __init__(self, block_pool: BlockPool) -> None:
        self.block_pool = block_pool
        self._blocks: dict[str, list[Block]] = {}

    def allocate(self, request: Request, num_blocks: int) -> bool:
        """Give the request its blocks; False, changing nothing, when too few are free."""
        if num_blocks > self.block_pool.num_free_blocks:
            return False
        self._blocks[request.request_id] = self.block_pool.allocate(num_blocks)
        return True

    def holds(self, request_id: str) -> bool:
        """True while the request holds encoder blocks (none of a decoder-only model's do)."""
        return request_id in self._blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's blocks (empty when it holds none)."""
        return [block.block_id for block in self._blocks.get(request_id, ())]

    def items(self) -> ItemsView[str, list[Block]]:
        """(request id, blocks) of every request holding some."""
        return self._blocks.items()

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last first (a no-op if it holds none)."""
        blocks = self._blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free(reversed(blocks))
