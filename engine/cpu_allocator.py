"""Keep large CPU tensors out of mmap, so element-wise ops on big activations stay cheap.

glibc's malloc serves big requests (the activations of a prefill step are megabytes) with a fresh
mmap and returns them to the kernel on free, so every temporary tensor pays page faults and page
zeroing again on first touch. Raising the mmap and trim thresholds keeps those allocations in the
reused heap (measured: docs/benchmarks-history.md, "What moved the numbers"). vLLM's CPU backend
gets the same effect by preloading tcmalloc.

A thread other than the main one would get its own arena, whose heaps are capped at 64 MiB and
trimmed eagerly, and so pay the page faults again. Limiting malloc to one arena keeps every
thread on the tuned heap.

The setting is process-wide, so the `pagedserve` entry point (server/cli.py) applies it, not the
engine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger("pagedserve")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def keep_large_allocations_in_heap(threshold_bytes: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds for this process. Returns whether it applied
    (False on non-glibc platforms, where nothing is changed)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (e.g. musl): leave the allocator alone
    applied = (
        bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes))
        and bool(mallopt(_M_TRIM_THRESHOLD, 2 * threshold_bytes - 1))
        and bool(mallopt(_M_ARENA_MAX, 1))
    )
    if applied:
        logger.debug("glibc malloc: thresholds %d bytes, one arena", threshold_bytes)
    return applied
