"""What the prefix cache gained and lost, in order: the KV events a router outside the server
follows to know which blocks this engine holds (engine/core/kv_events.py publishes them in
vLLM's format).

The BlockPool tells its log (when it has one) every change of its hash -> block map, the only
place blocks enter and leave the cache: a block cached (`stored`), a cached block reused for
other tokens or taken out (`removed`), the whole cache forgotten (`cleared`). A request's blocks
are stored one after another as they fill, so consecutive stores that continue one chain merge
into one event, as vLLM's do: a prompt of 40 blocks is one BlockStored of 40 hashes.

Hashes are `external_hash`es (scheduler/block_hash.py): 64-bit ints, the same for every KV-cache
group's block of one prefix, the group given apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.block_hash import BlockHash, external_hash, group_index
from pagedserve.scheduler.lora_request import LoRARequest


@dataclass
class BlockStored:
    """Blocks now in the cache: block i holds token_ids[i * block_size : (i + 1) * block_size]
    and chains from block i - 1 (the first from `parent_block_hash`, None for a prompt's first
    block)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora: LoRARequest | None = None
    group: int = 0


@dataclass
class BlockRemoved:
    """Blocks no longer in the cache (their memory went to other tokens)."""

    block_hashes: list[int]
    group: int = 0


@dataclass
class AllBlocksCleared:
    """Every block left the cache at once (a prefix-cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventLog:
    """The changes since the last `take`, merged where they continue each other."""

    block_size: int
    _events: list[KVEvent] = field(default_factory=list)

    def stored(
        self, block_hash: BlockHash, parent: BlockHash | None, lora: LoRARequest | None
    ) -> None:
        number, group = external_hash(block_hash), group_index(block_hash)
        parent_number = None if parent is None else external_hash(parent)
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, BlockStored)
            and last.group == group
            and last.lora == lora
            and parent_number is not None
            and last.block_hashes[-1] == parent_number
        ):
            last.block_hashes.append(number)
            last.token_ids += block_hash.token_ids
            return
        self._events.append(
            BlockStored(
                [number], parent_number, list(block_hash.token_ids), self.block_size, lora, group
            )
        )

    def removed(self, block_hash: BlockHash) -> None:
        number, group = external_hash(block_hash), group_index(block_hash)
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.group == group:
            last.block_hashes.append(number)
        else:
            self._events.append(BlockRemoved([number], group))

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]  # what came before no longer matters

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events
