"""The token rules of vLLM's extra sampling fields, applied to a batch's logits before
penalties, temperature and the top-k / top-p / min-p filters (vLLM's order):

- `allowed_token_ids`: every other token gets -inf;
- `bad_words_token_ids`: a one-token word's token gets -inf; a longer word's last token gets
  -inf where the row's output ends with the rest of the word;
- `min_tokens`: while a row has fewer output tokens, its EOS ids (unless ignore_eos) and
  stop_token_ids get -inf;
- `logit_bias`: added to its tokens' logits.

The host decides everything in `TokenRules.plan` (flat (row, token) index lists, so the device
does one scatter per kind for the whole batch); `apply` is tensor work only. Logprobs are not
affected: the sampler takes them from the raw logits, as vLLM's default ("raw_logprobs") does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.engine.worker.sampler import SamplingRow


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


@dataclass(frozen=True)
class TokenRules:
    """One batch's token rules on the device (each part None when no row uses it)."""

    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) -> -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values)
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, [rows] idx, ids)

    @staticmethod
    def plan(
        rows: Sequence[SamplingRow], eos_token_ids: frozenset[int], device: torch.device
    ) -> TokenRules | None:
        """The rules of these sampling rows; None when no row has any (the common case costs
        one property per row)."""
        ruled = [i for i, row in enumerate(rows) if row.params.has_token_rules]
        if not ruled:
            return None
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        allowed_rows: list[int] = []
        allowed_pos: list[int] = []
        allowed_ids: list[int] = []
        for i in ruled:
            row = rows[i]
            p = row.params
            banned: set[int] = set()
            if row.num_output_tokens < p.min_tokens:
                banned.update(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.update(eos_token_ids)
            if p.bad_words_token_ids:
                banned.update(_bad_word_bans(p.bad_words_token_ids, row.output_token_ids or ()))
            ban_rows += [i] * len(banned)
            ban_ids += banned
            for token_id, value in p.logit_bias or ():
                bias_rows.append(i)
                bias_ids.append(token_id)
                bias_values.append(value)
            if p.allowed_token_ids is not None:
                allowed_pos += [len(allowed_rows)] * len(p.allowed_token_ids)
                allowed_ids += p.allowed_token_ids
                allowed_rows.append(i)

        def columns(*parts: tuple[list, torch.dtype]) -> tuple[torch.Tensor, ...] | None:
            # A rule's columns on the device, or None when no row has it (its rows are empty).
            if not parts[0][0]:
                return None
            return tuple(_to_device(values, dtype, device) for values, dtype in parts)

        long = torch.long
        return TokenRules(
            banned=columns((ban_rows, long), (ban_ids, long)),
            bias=columns((bias_rows, long), (bias_ids, long), (bias_values, torch.float32)),
            allowed=columns((allowed_rows, long), (allowed_pos, long), (allowed_ids, long)),
        )

    def apply(self, logits: torch.Tensor) -> None:
        """In place, on float32 logits [rows, vocab]."""
        if self.allowed is not None:
            rows, pos, ids = self.allowed
            keep = torch.zeros((rows.shape[0], logits.shape[1]), dtype=torch.bool,
                               device=logits.device)  # fmt: skip
            keep[pos, ids] = True
            logits[rows] = logits[rows].masked_fill_(~keep, float("-inf"))
        if self.banned is not None:
            logits[self.banned] = float("-inf")
        if self.bias is not None:
            rows, ids, values = self.bias
            logits.index_put_((rows, ids), values, accumulate=True)


def _bad_word_bans(words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The last token of every bad word whose other tokens end the output (vLLM's rule)."""
    bans = []
    for word in words:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[-prefix:]) == list(word[:-1]):
            bans.append(word[-1])
    return bans
