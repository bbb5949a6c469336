"""Triton LoRA shrink and expand (Punica-style BGMV): the GPU twin of
`kernels.lora.lora_add_reference`, with the same arguments and the same sum, rounded where it
rounds (see `kernels.lora`).

Two launches, whose grids and constexprs come from shapes only (no `.item()`, no host sync), so
a step that calls them can be captured in a CUDA graph; each program reads its token's slot from
`token_slots` on the device:

1. shrink, program (token, part j): tmp[t, j, :R] = A[s, j] @ x[t], over `in` in BLOCK_K chunks,
   accumulated in float32 and rounded to the dtype (kept in a float32 [T, J, R] buffer).
2. expand, program (token, BLOCK_N output rows): y[t, n] += B[s, n, :R] . tmp[t, j(n), :R] for
   its rows, accumulated in float32, the product rounded to the dtype, then the sum. A tile may
   straddle a part boundary (q | k of a qkv projection): each row finds its part from the
   boundaries, passed as constexprs (J <= 3, the stacked projections' most).

A program whose token has slot -1 (the base model), or a slot past the last, returns at once.
The padded rank R is computed for every adapter (the kernels do not know the actual ranks), so
the slots' padding must be zeros; rank is small next to `in` and `out`, and decode is bound by
reading A and B anyway. Products are elementwise multiplies and a `tl.sum`, not `tl.dot`: one
token per program is a matrix-vector product, with no tile of tokens to feed a tensor core.

Under TRITON_INTERPRET=1 (set before this module is imported) the same kernels run on CPU tensors
with numpy; tests/kernels/test_lora_kernels.py checks them against the reference. The interpreter
truncates float32 to bfloat16, so there (INTERP_BF16, as in `kernels.triton_moe`) bfloat16
results are rounded to nearest on their bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pagedserve.kernels import triton_attention, validation
from pagedserve.kernels.lora import check_lora_args, part_offsets
from pagedserve.kernels.triton_moe import round_to

__all__ = ["MAX_PARTS", "lora_add_triton"]

# The most output parts a projection may have: each part boundary is a constexpr of the expand.
MAX_PARTS = 3


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, IN]
    a_ptr,  # [S, J, R, IN]
    tmp_ptr,  # out: [T, J, R] float32, contiguous
    token_slots_ptr,  # [T]
    num_slots,
    x_stride_t,
    x_stride_k,
    a_stride_s,
    a_stride_j,
    a_stride_r,
    a_stride_k,
    IN: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    RANK: tl.constexpr,  # the slots' padded R
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    """Program (token, part): tmp[t, j, :R] = A[s, j] @ x[t], rounded to x's dtype."""
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    slot = tl.load(token_slots_ptr + token).to(tl.int64)
    # No adapter (-1), or a slot past the last (the reference would raise, which needs the host).
    if (slot < 0) | (slot >= num_slots):
        return
    r = tl.arange(0, BLOCK_R)
    r_ok = r < RANK
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * x_stride_t + ks * x_stride_k
    a_ptrs = (
        a_ptr + slot * a_stride_s + part * a_stride_j
        + r[:, None] * a_stride_r + ks[None, :] * a_stride_k
    )  # fmt: skip
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, IN, BLOCK_K):
        k_ok = ks < IN - k0
        xk = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
        x_ptrs += BLOCK_K * x_stride_k
        a_ptrs += BLOCK_K * a_stride_k
    # PEFT's lora_A(x) is in the model's dtype: rounded here, kept in float32 for the expand.
    shrunk = round_to(acc, x_ptr.dtype.element_ty, INTERP_BF16).to(tl.float32)
    tl.store(tmp_ptr + (token * NUM_PARTS + part) * RANK + r, shrunk, mask=r_ok)


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [T, OUT], updated in place
    b_ptr,  # [S, OUT, R]
    tmp_ptr,  # [T, J, R] float32, contiguous, from the shrink
    token_slots_ptr,
    num_slots,
    y_stride_t,
    y_stride_n,
    b_stride_s,
    b_stride_n,
    b_stride_r,
    OUT: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    BOUNDARY_1: tl.constexpr,  # the first row of part 1 (OUT when there is none)
    BOUNDARY_2: tl.constexpr,  # the first row of part 2 (OUT when there is none)
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    """Program (token, n): y[t, rows] += B[s, rows] . tmp[t, part(row)] for rows = n * BLOCK_N +
    [0, BLOCK_N); the product and the sum each rounded to y's dtype."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < OUT
    # Each row's part, so a tile that straddles a boundary reads the right part's tmp.
    part = (rows >= BOUNDARY_1).to(tl.int64) + (rows >= BOUNDARY_2).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    mask = row_ok[:, None] & (r < RANK)[None, :]
    shrunk = tl.load(
        tmp_ptr + (token * NUM_PARTS + part[:, None]) * RANK + r[None, :], mask=mask, other=0.0
    )
    b_ptrs = b_ptr + slot * b_stride_s + rows[:, None] * b_stride_n + r[None, :] * b_stride_r
    b = tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    delta = round_to(tl.sum(b * shrunk, axis=1), dtype, INTERP_BF16).to(tl.float32)
    y_ptrs = y_ptr + token * y_stride_t + rows * y_stride_n
    y = tl.load(y_ptrs, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, round_to(y + delta, dtype, INTERP_BF16), mask=row_ok)


def lora_add_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    token_slots: torch.Tensor,
    a_slots: torch.Tensor,
    b_slots: torch.Tensor,
    part_sizes: Sequence[int],
    *,
    block_n: int | None = None,
    block_k: int | None = None,
) -> None:
    """y[t] += B[s] (A[s, j] x[t]) per part for every token t of slot s = token_slots[t] >= 0,
    IN PLACE; see `kernels.lora.lora_add_reference` (same arguments, same rounding, sums in
    another order). The slots' rank padding must be zeros. `block_n` / `block_k` override the
    tile sizes (powers of two; tests force small ones)."""
    if validation.CHECK_ARGS:
        check_lora_args(y, x, a_slots, b_slots, part_sizes, token_slots)
        triton_attention.check_runnable(y.device)
    num_slots, num_parts, rank, in_features = a_slots.shape
    num_tokens, out_features = y.shape
    if num_parts > MAX_PARTS:
        raise ValueError(f"at most {MAX_PARTS} output parts, got {num_parts}")
    if num_tokens == 0 or out_features == 0 or rank == 0:
        return
    block_r = triton.next_power_of_2(rank)
    # Tiles of about 8K float32 values: [BLOCK_R, BLOCK_K] of A, [BLOCK_N, BLOCK_R] of B.
    if block_k is None:
        block_k = min(max(triton.next_power_of_2(in_features), 16), max(8192 // block_r, 32))
    if block_n is None:
        block_n = min(max(triton.next_power_of_2(out_features), 16), max(8192 // block_r, 16))
    interp_bf16 = triton_attention.INTERPRETED and y.dtype == torch.bfloat16
    # Every entry is written by the shrink before the expand reads it, except those of tokens
    # without an adapter, which neither reads.
    tmp = torch.empty(num_tokens, num_parts, rank, dtype=torch.float32, device=y.device)
    _lora_shrink_kernel[(num_tokens, num_parts)](
        x,
        a_slots,
        tmp,
        token_slots,
        num_slots,
        *x.stride(),
        *a_slots.stride(),
        IN=in_features,
        NUM_PARTS=num_parts,
        RANK=rank,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        INTERP_BF16=interp_bf16,
        num_warps=4,
    )
    offsets = part_offsets(part_sizes)[1:-1]  # the boundaries between parts
    boundaries = offsets + [out_features] * (MAX_PARTS - 1 - len(offsets))
    _lora_expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        y,
        b_slots,
        tmp,
        token_slots,
        num_slots,
        *y.stride(),
        *b_slots.stride(),
        OUT=out_features,
        NUM_PARTS=num_parts,
        BOUNDARY_1=boundaries[0],
        BOUNDARY_2=boundaries[1],
        RANK=rank,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        INTERP_BF16=interp_bf16,
        num_warps=4,
    )
