"""The adapters' share of a step: each projection of the base model that an adapter may target
holds every slot's weights (`LoRAProjection`), and all of them read one `LoRAStep`, which says
which slot each token of the step uses.

    y = x @ W^T                      the base projection (engine/models/model.py, unchanged)
    y[t] += B[s_t] @ (A[s_t] @ x[t])  for every token t whose request names an adapter (slot s_t)

The delta is one grouped operation per projection for the whole batch, whatever mix of adapters
and base-model requests it holds (kernels/lora.py says how, on CPU and on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedserve import kernels
from pagedserve.engine.lora.adapter import LoRAWeights
from pagedserve.kernels.lora import group_tokens

NO_SLOT = -1


class LoRAStep:
    """Which slot each token of the running step reads (`set` before every forward pass).

    On CUDA the slots live in one device buffer for the engine's life: a decode step captured
    in a CUDA graph reads the buffer's first rows, so replaying it with other adapters needs only
    new values there. On CPU the step keeps the tokens grouped by slot instead (`groups`), built
    once on the host and shared by every layer."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.device = device
        self.slots = torch.full((max_tokens,), NO_SLOT, dtype=torch.int32, device=device)
        self.groups: list = []
        self.active = False  # some token of the step uses an adapter
        self.slot_ranks: list[int] = []  # each slot's adapter rank (0: empty)

    def set(self, token_slots: np.ndarray) -> None:
        """The step's tokens' slots ([num_tokens], NO_SLOT for the base model)."""
        self.active = bool((token_slots != NO_SLOT).any())
        if self.device.type == "cpu":
            self.groups = group_tokens(token_slots, self.slot_ranks) if self.active else []
            return
        self.slots.fill_(NO_SLOT)  # a captured graph's padding rows read no adapter
        if self.active:
            n = len(token_slots)
            self.slots[:n].copy_(torch.from_numpy(token_slots.astype(np.int32)), non_blocking=True)

    def clear(self) -> None:
        self.set(np.empty(0, dtype=np.int32))


class LoRAProjection:
    """Every slot's adapter weights for one projection of one layer: a [slots, parts, rank, in]
    (part j's A, rank rows zero past the adapter's own), b [slots, out, rank] (the parts' B rows
    in output order, scaled)."""

    def __init__(
        self,
        step: LoRAStep,
        parts: Sequence[int],
        in_features: int,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
    ) -> None:
        self.step = step
        self.parts = tuple(parts)
        device = step.device
        self.a = torch.zeros(
            num_slots, len(parts), max_rank, in_features, dtype=dtype, device=device
        )
        self.b = torch.zeros(num_slots, sum(parts), max_rank, dtype=dtype, device=device)
        self.targeted = [False] * num_slots  # the slot's adapter has weights here

    def add(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += the delta of each token's adapter (in place; tokens of the base model as they
        are)."""
        step = self.step
        if y.is_cuda:
            # (The worker sets `active` while it captures CUDA graphs: their replays may hold
            # adapters.)
            if step.active:
                slots = step.slots[: x.shape[0]]
                kernels.lora_add(y, x, slots, [], self.a, self.b, self.parts)
            return
        # Only the slots whose adapter targets this projection (the others' weights are zeros).
        groups = [group for group in step.groups if self.targeted[group[0]]]
        if groups:
            kernels.lora_add(y, x, step.slots, groups, self.a, self.b, self.parts)

    def load(self, slot: int, weights: LoRAWeights | None) -> None:
        """Put an adapter's weights for this projection into `slot` (zeros: it leaves the
        projection alone)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.targeted[slot] = weights is not None
        if weights is not None:
            rank = weights.a.shape[1]
            self.a[slot, :, :rank].copy_(weights.a)
            self.b[slot, :, :rank].copy_(weights.b)

    @property
    def num_bytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()
