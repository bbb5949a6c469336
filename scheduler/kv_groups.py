"""KV-cache groups: how a model whose layers attend differently (full attention next to sliding
windows, as in Gemma 2 and 3) shares one block pool without giving every layer the full context.

Layers of one attention kind form groups of equal size k; each group has its own block table per
request, and all groups draw their blocks from one pool. The KV memory is k tensors per K and V
([num_blocks, block_size, kv_heads, head_dim] each), and the layer at position j of its group
uses tensor j: a block id belongs to one group at a time, so block b of tensor j is the layer-j
page of whichever group holds b. One block id therefore costs k layers' pages, whatever its group.

    Gemma 3, 6 layers (5 sliding, 1 full):  k = 1, groups [full: 5], [sliding: 0], [1], [2], ...
    Gemma 2, 42 layers alternating:         k = 21, groups [full: 1, 3, ...], [sliding: 0, 2, ...]
    Llama, every layer full:                k = L, one group (the plain layout)

A full group holds every block of the sequence; a sliding group of window W keeps only the
blocks the next tokens can see (positions > p - W for a chunk starting at position p) and gives
the others back as the sequence grows. The groups of one request allocate in lockstep (a block
per group when the sequence enters a new block), so a request's tables are stored interleaved,
one entry per group per block: entry i * G + g is block i of group g.

The group size is the smallest count of layers of one kind; a kind whose count is not a multiple
of it leaves its last group short (Gemma 3 27B: 10 full and 52 sliding layers make one full and
six sliding groups of 10, the last of 2: its blocks leave 8 of their 10 pages unused).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.scheduler.utils import cdiv


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # None: full attention
    layers: tuple[int, ...]  # the model layers in the group; layer layers[j] uses tensor j


def group_layers(windows: Sequence[int | None]) -> tuple[KVCacheGroup, ...]:
    """The groups of a model whose layer i attends over `windows[i]` keys (None: all of them):
    full-attention groups first, then each window size in order of first appearance."""
    if not windows:
        raise ValueError("a model needs at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for kind in sorted(set(windows), key=lambda w: (w is not None, windows.index(w))):
        kinds[kind] = [i for i, w in enumerate(windows) if w == kind]
    size = min(len(layers) for layers in kinds.values())
    return tuple(
        KVCacheGroup(kind, tuple(layers[start : start + size]))
        for kind, layers in kinds.items()
        for start in range(0, len(layers), size)
    )


def layers_per_block(groups: Sequence[KVCacheGroup]) -> int:
    """k: the layer pages one block id holds (the size of the largest group)."""
    return max(len(group.layers) for group in groups)


def first_live_block(window: int | None, position: int, block_size: int) -> int:
    """The first block a chunk starting at `position` reads in a group of `window` (0 for full
    attention): its first token sees positions > position - window."""
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size


def blocks_per_request(
    windows: Sequence[int | None], num_tokens: int, block_size: int, chunk: int
) -> int:
    """The most blocks a request of `num_tokens` tokens holds across groups of these windows
    while computing chunks of at most `chunk` tokens: all of its blocks in a full group, in a
    sliding group those spanning a window plus a chunk (capped at all of them)."""
    total = cdiv(num_tokens, block_size)
    held = 0
    for window in windows:
        if window is None:
            held += total
        else:
            # W - 1 positions before the chunk and the chunk's own: a span of n positions
            # touches at most cdiv(n - 1, block_size) + 1 blocks.
            span = window - 1 + min(chunk, num_tokens)
            held += min(total, cdiv(span - 1, block_size) + 1)
    return held
