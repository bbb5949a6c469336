"""Counters of the KV manager's work: one object, which its parts add to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVCacheStats:
    """What a `KVCacheManager` has done so far (mutable: its parts count here, and the manager
    shows each counter under its own name)."""

    # The prefix cache, in tokens, counted once per admission: prompt tokens looked up, and
    # those found cached.
    num_prefix_cache_queries_tokens: int = 0
    num_prefix_cache_hits_tokens: int = 0
    num_block_copies: int = 0  # copy-on-write copies
    num_swapped_out_blocks: int = 0  # device blocks copied to the host pool
    num_swapped_in_blocks: int = 0  # and back
