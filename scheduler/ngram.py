"""Draft tokens by prompt lookup (n-gram speculative decoding): when the last n tokens of a
sequence occurred earlier in it (prompt or output), propose the tokens that followed them then.

Each request keeps an `NgramIndex`: where every n-gram (n_min <= n <= n_max) of its tokens last
ended, filled in as tokens arrive, so a proposal costs a few dictionary lookups per step instead
of a scan of the whole context.
"""

from __future__ import annotations


class NgramIndex:
    """The last end position of each n-gram of a growing token list, for proposals."""

    __slots__ = ("n_min", "n_max", "_last_end", "_indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min = n_min
        self.n_max = n_max
        # n-gram (a tuple; sizes differ, so keys of different n never collide) -> the position
        # of its last token, for n-grams ending before `_indexed`.
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (n_max down to n_min tokens long) found in it; [] without a match. `tokens`
        must be the same list, only ever appended to, between calls."""
        end = len(tokens) - 1  # the suffix ends here; occurrences must end before it
        last_end = self._last_end
        for pos in range(self._indexed, end):
            for n in range(self.n_min, min(self.n_max, pos + 1) + 1):
                last_end[tuple(tokens[pos - n + 1 : pos + 1])] = pos
        self._indexed = max(self._indexed, end)
        for n in range(min(self.n_max, end + 1), self.n_min - 1, -1):
            pos = last_end.get(tuple(tokens[end - n + 1 :]))
            if pos is not None:
                return tokens[pos + 1 : pos + 1 + k]
        return []
