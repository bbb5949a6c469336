"""The grouped LoRA matmuls of multi-LoRA serving (Punica's "shrink" and "expand"), in torch.

Many adapters share one base model; each token of a batch belongs to one adapter slot, or to
none (slot -1: the base model). For one projection of one layer the adapters live in slot
tensors, so that a step never has to look an adapter up by name:

    a_slots      [S, J, R, in]  slot s, output part j's LoRA A; rank rows zero-padded to R
    b_slots      [S, out, R]    slot s's LoRA B, rows in output order (part 0's, part 1's, ...),
                                the scaling folded in; rank columns zero-padded to R
    part_sizes   J ints summing to out: the parts of a stacked projection (qkv: J = 3, q k v;
                 gate_up: J = 2; o and down: J = 1). Each part has its own A and shares x.

For token t of slot s and output row n of part j:

    y[t, n] += sum_r b_slots[s, n, r] * (sum_k a_slots[s, j, r, k] * x[t, k])

Rounding, as PEFT computes `lora_B(lora_A(x))` in the model's dtype and adds it to the base
output: the shrink x @ A^T accumulates in float32 and is rounded to the dtype, the expand
(that @ B^T) accumulates in float32 and is rounded to the dtype, and the sum y + delta is rounded
once more. torch's matmuls accumulate in float32 for float16/bfloat16 on CPU and GPU; the
reference spells it out with explicit float32 products, so it cannot depend on a BLAS.

Three implementations of the same sum:

* `lora_add_reference`: a loop over tokens, one pair of matrix-vector products each. Plain and
  obviously right; the tests' oracle.
* `lora_add_cpu`: the CPU path. Tokens are grouped by slot once per model step (`group_tokens`,
  from the host's copy of the slots; every layer and projection of the step reuses the groups),
  and each group does one matmul against its slot's A truncated to the adapter's actual rank
  (all J parts at once, as one [J * rank, in] weight) and one matmul per part against B. The
  padding up to R is never multiplied: a rank-16 adapter in rank-64 slots costs rank 16.
* `kernels.triton_lora.lora_add_triton`: the GPU path, two kernels whose launch does not depend
  on the slots' values (CUDA graphs); it computes the padded rank R and reads the slots on the
  device, so the padding there must be zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeAlias

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.kernels import validation

__all__ = [
    "LoRAGroup",
    "LoRAGroups",
    "check_lora_args",
    "dense_weights",
    "group_tokens",
    "lora_add_cpu",
    "lora_add_cpu_dense",
    "lora_add_reference",
    "part_offsets",
    "slot_mask",
]


class LoRAGroup(NamedTuple):
    """The tokens of one adapter slot in a step: `tokens` is a slice of the batch when they are
    contiguous (a request's tokens are, so it is the common case: a view, no gather), else an
    int64 index tensor of their positions, ascending."""

    slot: int
    rank: int  # the adapter's actual rank, <= the slots' padded R
    tokens: torch.Tensor | slice


# One model step's groups, in ascending slot order; empty when no token has an adapter.
LoRAGroups: TypeAlias = list[LoRAGroup]


def part_offsets(part_sizes: Sequence[int]) -> list[int]:
    """The first output row of each part, and `out` last: [0, size0, size0 + size1, ...]."""
    offsets = [0]
    for size in part_sizes:
        offsets.append(offsets[-1] + int(size))
    return offsets


def check_lora_args(
    y: torch.Tensor,
    x: torch.Tensor,
    a_slots: torch.Tensor,
    b_slots: torch.Tensor,
    part_sizes: Sequence[int],
    token_slots: torch.Tensor | None = None,
) -> None:
    """Raise ValueError unless the shapes and dtypes agree (shapes only: the slot values would
    need the host)."""
    if x.dim() != 2 or y.dim() != 2 or a_slots.dim() != 4 or b_slots.dim() != 3:
        raise ValueError(
            "expected x [T, in], y [T, out], a_slots [S, J, R, in] and b_slots [S, out, R], got "
            f"{tuple(x.shape)}, {tuple(y.shape)}, {tuple(a_slots.shape)}, {tuple(b_slots.shape)}"
        )
    num_slots, num_parts, max_rank, in_features = a_slots.shape
    num_tokens, out_features = y.shape
    if len(part_sizes) != num_parts or any(int(size) < 0 for size in part_sizes):
        raise ValueError(f"part_sizes {tuple(part_sizes)} must be {num_parts} sizes (a_slots' J)")
    if sum(part_sizes) != out_features:
        raise ValueError(f"part_sizes {tuple(part_sizes)} must sum to y's {out_features} columns")
    if x.shape != (num_tokens, in_features):
        raise ValueError(f"x must be {(num_tokens, in_features)}, got {tuple(x.shape)}")
    if b_slots.shape != (num_slots, out_features, max_rank):
        raise ValueError(
            f"b_slots must be {(num_slots, out_features, max_rank)}, got {tuple(b_slots.shape)}"
        )
    dtypes = {t.dtype for t in (y, x, a_slots, b_slots)}
    if len(dtypes) != 1 or y.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"y, x, a_slots and b_slots must share one float dtype, got {dtypes}")
    if token_slots is not None and (
        token_slots.shape != (num_tokens,) or token_slots.dtype.is_floating_point
    ):
        raise ValueError(
            f"token_slots must be an integer tensor of shape ({num_tokens},), got "
            f"{token_slots.dtype} {tuple(token_slots.shape)}"
        )


def lora_add_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    token_slots: torch.Tensor,
    a_slots: torch.Tensor,
    b_slots: torch.Tensor,
    part_sizes: Sequence[int],
) -> None:
    """y[t] += B[s] (A[s, j] x[t]) for every token t of slot s = token_slots[t] >= 0, part by
    part, IN PLACE; tokens of slot -1 are left alone. One token at a time (the tests' oracle;
    it reads the slots on the host). Rounded as the module docstring says."""
    check_lora_args(y, x, a_slots, b_slots, part_sizes, token_slots)
    offsets = part_offsets(part_sizes)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        xt = x[t].float()
        for j in range(len(part_sizes)):
            rows = slice(offsets[j], offsets[j + 1])
            shrunk = (a_slots[slot, j].float() @ xt).to(y.dtype)
            delta = (b_slots[slot, rows].float() @ shrunk.float()).to(y.dtype)
            y[t, rows] += delta


def group_tokens(token_slots: np.ndarray, slot_ranks: Sequence[int]) -> LoRAGroups:
    """The step's tokens grouped by adapter slot, from the host's array of slots (-1: none):
    one (slot, slot_ranks[slot], tokens) per slot present, in ascending slot order, with tokens
    a slice when that slot's tokens are contiguous and an int64 index tensor otherwise. Built
    once per step and shared by every layer and projection of it."""
    slots = np.asarray(token_slots).reshape(-1)
    positions = np.flatnonzero(slots >= 0)
    if positions.size == 0:
        return []
    # A stable sort keeps each slot's positions ascending; runs of equal slots are the groups.
    positions = positions[np.argsort(slots[positions], kind="stable")]
    sorted_slots = slots[positions]
    starts = np.flatnonzero(np.diff(sorted_slots)) + 1
    groups = []
    for run in np.split(positions, starts):
        slot, first, last = int(slots[run[0]]), int(run[0]), int(run[-1])
        if last - first + 1 == run.size:  # ascending and distinct: contiguous iff it spans size
            tokens: torch.Tensor | slice = slice(first, last + 1)
        else:
            tokens = torch.from_numpy(run.astype(np.int64))
        groups.append(LoRAGroup(slot, int(slot_ranks[slot]), tokens))
    return groups


def lora_add_cpu(
    y: torch.Tensor,
    x: torch.Tensor,
    groups: Sequence[tuple[int, int, torch.Tensor | slice]],
    a_slots: torch.Tensor,
    b_slots: torch.Tensor,
    part_sizes: Sequence[int],
) -> None:
    """`lora_add_reference` for the tokens of `groups` (from `group_tokens`), IN PLACE, with
    two matmuls per group and part at the adapter's actual rank; tokens in no group are left
    alone. Rank columns past a slot's rank are never read."""
    if validation.CHECK_ARGS:
        check_lora_args(y, x, a_slots, b_slots, part_sizes)
        for slot, rank, _ in groups:
            if not (0 <= slot < a_slots.shape[0] and 0 <= rank <= a_slots.shape[2]):
                raise ValueError(
                    f"group (slot {slot}, rank {rank}) outside the slots' {a_slots.shape[0]} "
                    f"slots of rank {a_slots.shape[2]}"
                )
    num_parts, in_features = a_slots.shape[1], a_slots.shape[3]
    offsets = part_offsets(part_sizes)
    for slot, rank, tokens in groups:
        if rank == 0:
            continue
        xs = x[tokens]  # a view for a slice, a gather for an index tensor
        # All J parts' A in one [J * rank, in] weight: one matmul instead of J small ones (the
        # reshape copies J * rank * in values when rank < R, cheaper than the J - 1 extra calls,
        # above all in bfloat16, where each call costs a oneDNN dispatch).
        a = a_slots[slot, :, :rank].reshape(num_parts * rank, in_features)
        shrunk = F.linear(xs, a)  # [n, J * rank]: float32 accumulation, rounded to the dtype
        for j in range(num_parts):
            if offsets[j] == offsets[j + 1]:
                continue
            rows = slice(offsets[j], offsets[j + 1])
            # b_slots[slot, rows, :rank] is strided (row stride R): BLAS reads it in place.
            delta = F.linear(shrunk[:, j * rank : (j + 1) * rank], b_slots[slot, rows, :rank])
            if isinstance(tokens, slice):
                y[tokens, rows].add_(delta)  # in place on the view, without += 's copy back
            else:
                # The indices of a group are distinct, so index_add_ rounds y + delta once per
                # element, as += does.
                y[:, rows].index_add_(0, tokens, delta)


def dense_weights(
    a_slots: torch.Tensor, b_slots: torch.Tensor, part_sizes: Sequence[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`lora_add_cpu_dense`'s weights: every slot's and part's A as one [S * J * R, in] matrix,
    and for each part j its B rows of every slot as one [out_j, S * R] matrix. Views (so a
    caller can keep them, packed for its BLAS, across steps) when a_slots is contiguous and
    b_slots a permuted view of a contiguous [out, S, R] tensor; copies otherwise."""
    num_slots, num_parts, max_rank, in_features = a_slots.shape
    a_flat = a_slots.reshape(num_slots * num_parts * max_rank, in_features)
    b_rows = b_slots.permute(1, 0, 2)  # [out, S, R]
    offsets = part_offsets(part_sizes)
    b_parts = [
        b_rows[offsets[j] : offsets[j + 1]].reshape(part_sizes[j], num_slots * max_rank)
        for j in range(num_parts)
    ]
    return a_flat, b_parts


def lora_add_cpu_dense(
    y: torch.Tensor,
    x: torch.Tensor,
    slot_mask: torch.Tensor,
    a_flat: torch.Tensor,
    b_parts: Sequence[torch.Tensor],
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> None:
    """`lora_add_reference` IN PLACE with every token against every slot at the padded rank,
    each token's products with the other slots zeroed by `slot_mask` ([T, S], 1 where token t
    uses slot s, else 0; a row of zeros: the base model): 1 + J matmuls per projection whatever
    the number of adapters, on `dense_weights`' matrices (through `linear`: the engine passes
    its oneDNN-packed one). For steps of few tokens (decode), where each small matmul costs a
    library call more than its arithmetic and the grouped path's calls grow with the adapters
    (docs/benchmarks-history.md, "Multi-LoRA on CPU")."""
    num_tokens, num_slots = slot_mask.shape
    num_parts = len(b_parts)
    max_rank = a_flat.shape[0] // (num_slots * num_parts)
    if validation.CHECK_ARGS and (
        x.shape[0] != num_tokens or a_flat.shape[0] != num_slots * num_parts * max_rank
    ):
        raise ValueError(
            f"slot_mask {tuple(slot_mask.shape)} does not fit x {tuple(x.shape)} and A "
            f"{tuple(a_flat.shape)}"
        )
    shrunk = linear(x, a_flat).view(num_tokens, num_slots, num_parts, max_rank)
    shrunk.mul_(slot_mask.view(num_tokens, num_slots, 1, 1))  # 0 or 1: exact
    start = 0
    for j, b in enumerate(b_parts):
        rows = slice(start, start + b.shape[0])
        start = rows.stop
        part = shrunk[:, :, j].reshape(num_tokens, num_slots * max_rank)
        y[:, rows].add_(linear(part, b))


def slot_mask(token_slots: np.ndarray, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, num_slots] of `dtype`: 1 at (t, token_slots[t]) for tokens with a slot, else 0
    (`lora_add_cpu_dense`'s mask)."""
    slots = np.asarray(token_slots, dtype=np.int64).reshape(-1)
    mask = torch.zeros(len(slots), num_slots, dtype=dtype)
    tokens = np.flatnonzero(slots >= 0)
    mask[torch.from_numpy(tokens), torch.from_numpy(slots[tokens])] = 1
    return mask
