"""Integer arithmetic shared by every package (pure Python, like the rest of `scheduler`)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, exactly (no float rounding): e.g. the blocks that a tokens fill
    at b tokens per block."""
    return -(-a // b)
