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
from pagedserve.engine.models.cpu_linear import linear, pack, unpack
from pagedserve.kernels import cpu_features
from pagedserve.kernels.lora import dense_weights, group_tokens, lora_add_cpu_dense, slot_mask

NO_SLOT = -1
# CPU steps multiply every token by every slot, masked (1 + J matmuls per projection on packed
# weights, whose rows are each token's alone): a token's delta is the same whatever else shares
# the step. With PAGEDSERVE_BATCH_VARIANT=1 only steps of (fewest, most) tokens do; the others
# group the tokens by slot (1 + J per adapter, at its own rank). Where the two cross, by dtype:
# docs/benchmarks-history.md, "Multi-LoRA on CPU".
DENSE_TOKENS = {torch.bfloat16: (2, 128), torch.float32: (8, 32)}


class LoRAStep:
    """Which slot each token of the running step reads (`set` before every forward pass).

    On CUDA the slots live in one device buffer for the engine's life: a decode step captured
    in a CUDA graph reads the buffer's first rows, so replaying it with other adapters needs only
    new values there. On CPU the step keeps a [tokens, slots] mask (few tokens) or the tokens
    grouped by slot, built once on the host and shared by every layer."""

    def __init__(
        self, max_tokens: int, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.device, self.dtype, self.num_slots = device, dtype, num_slots
        self.slots = torch.full((max_tokens,), NO_SLOT, dtype=torch.int32, device=device)
        self.slot_ranks = [0] * num_slots  # each slot's adapter rank (0: empty)
        self.active = False  # some token of the step uses an adapter
        self.used: set[int] = set()  # the slots the step's tokens use
        self.mask: torch.Tensor | None = None
        self.groups: list = []

    def set(self, token_slots: np.ndarray) -> None:
        """The step's tokens' slots ([num_tokens], NO_SLOT for the base model)."""
        self.used = set(np.unique(token_slots[token_slots != NO_SLOT]).tolist())
        self.active = bool(self.used)
        if self.device.type == "cpu":
            fewest, most = DENSE_TOKENS.get(self.dtype, (0, -1))
            if not cpu_features.batch_variant():
                fewest, most = 0, len(token_slots)
            dense = self.active and fewest <= len(token_slots) <= most
            self.mask = slot_mask(token_slots, self.num_slots, self.dtype) if dense else None
            grouped = self.active and not dense
            self.groups = group_tokens(token_slots, self.slot_ranks) if grouped else []
            return
        self.slots.fill_(NO_SLOT)  # a captured graph's padding rows read no adapter
        if self.active:
            n = len(token_slots)
            self.slots[:n].copy_(torch.from_numpy(token_slots.astype(np.int32)), non_blocking=True)

    def clear(self) -> None:
        if self.active or self.device.type != "cpu":
            self.set(np.empty(0, dtype=np.int32))


class LoRAProjection:
    """Every slot's adapter weights for one projection of one layer: `a` [slots, parts, rank,
    in] (part j's A, rank rows zero past the adapter's own) and `b` [slots, out, rank] (the
    parts' B rows in output order, scaled). B is stored [out, slots, rank], `b` a permuted view
    of it: the CPU's masked path reads each part's rows of all slots as one weight."""

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
        shape_a = (num_slots, len(parts), max_rank, in_features)
        self.a = torch.zeros(shape_a, dtype=dtype, device=device)
        b_rows = torch.zeros(sum(parts), num_slots, max_rank, dtype=dtype, device=device)
        self.b = b_rows.permute(1, 0, 2)
        self.targeted = [False] * num_slots  # the slot's adapter has weights here
        # The CPU's masked path multiplies by these views of a and b, oneDNN-packed where the
        # CPU allows (re-packed whenever a slot is filled): 1.5-1.8x faster for decode's rows.
        self.a_flat, self.b_parts = dense_weights(self.a, self.b, self.parts)

    def add(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += the delta of each token's adapter (in place; tokens of the base model as they
        are)."""
        step = self.step
        if not step.active:  # (the worker sets it while it captures CUDA graphs)
            return
        if y.is_cuda:
            slots = step.slots[: x.shape[0]]
            kernels.lora_add(y, x, self.a, self.b, self.parts, token_slots=slots)
            return
        # Only the slots whose adapter targets this projection (the others' weights are zeros).
        if not any(self.targeted[slot] for slot in step.used):
            return
        if step.mask is not None:
            lora_add_cpu_dense(y, x, step.mask, self.a_flat, self.b_parts, linear)
            return
        groups = [group for group in step.groups if self.targeted[group.slot]]
        kernels.lora_add(y, x, self.a, self.b, self.parts, groups=groups)

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
        if self.a.device.type == "cpu":
            for weight in (self.a_flat, *self.b_parts):
                unpack(weight)
                pack(weight)

    @property
    def num_bytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()
