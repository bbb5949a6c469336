"""The grouped LoRA matmuls (kernels/lora.py, kernels/triton_lora.py): the CPU grouped path and
the Triton shrink/expand against the per-token reference, and the reference against a float64
sum written another way.

The batch mixes three adapters of ranks 8, 16 and 64 in slots of rank 64 (so two of them are
padded), a fourth slot that no token uses, and base-model tokens (slot -1); one adapter's tokens
are contiguous runs (a slice), another's are scattered (an index tensor). The projection is a
stacked qkv-like one of J = 3 unequal parts, so each part must read its own A.

Without a GPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set in
tests/conftest.py), with small shapes: every program runs in numpy.

Tolerances: float32 within 1e-5 (the paths sum in different orders); bfloat16 within bf16's
rounding of the delta (the intermediate is rounded to bfloat16, so one ulp there moves the delta
by up to 2^-8 of a term), and most elements bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.kernels import triton_attention
from pagedserve.kernels.lora import (
    LoRAGroup,
    dense_weights,
    group_tokens,
    lora_add_cpu,
    lora_add_cpu_dense,
    lora_add_reference,
    part_offsets,
    slot_mask,
)
from pagedserve.kernels.triton_lora import lora_add_triton

needs_interpreter = pytest.mark.skipif(
    not triton_attention.INTERPRETED,
    reason="CPU tensors need Triton's interpreter, which tests/conftest.py turns on only on "
    "machines without a GPU",
)

# Slot ranks: slots 0-2 hold adapters of ranks 8, 16 and 64; slot 3 one of rank 32 that no token
# of the batch uses. The slots' padded rank R is 64.
SLOT_RANKS = (8, 16, 64, 32)
MAX_RANK = 64
# Slot 0: tokens 1-3 (contiguous), slot 2: tokens 4-6 (contiguous), slot 1: tokens 8, 10, 11,
# 13 (scattered); tokens 0, 7, 9 and 12 are the base model's.
TOKEN_SLOTS = [-1, 0, 0, 0, 2, 2, 2, -1, 1, -1, 1, 1, -1, 1]
BASE_TOKENS = [t for t, s in enumerate(TOKEN_SLOTS) if s < 0]
LORA_TOKENS = [t for t, s in enumerate(TOKEN_SLOTS) if s >= 0]


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * scale


def make_slots(
    in_features: int, part_sizes: tuple[int, ...], dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_slots, b_slots) of random adapters of SLOT_RANKS, the rank padding zeroed."""
    out_features = sum(part_sizes)
    num_slots = len(SLOT_RANKS)
    a = randn(num_slots, len(part_sizes), MAX_RANK, in_features, seed=seed, scale=0.2)
    b = randn(num_slots, out_features, MAX_RANK, seed=seed + 1, scale=0.2)
    for slot, rank in enumerate(SLOT_RANKS):
        a[slot, :, rank:] = 0
        b[slot, :, rank:] = 0
    return a.to(dtype), b.to(dtype)


def make_batch(
    in_features: int, part_sizes: tuple[int, ...], dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, x, token_slots, a_slots, b_slots) for TOKEN_SLOTS."""
    a, b = make_slots(in_features, part_sizes, dtype, seed)
    num_tokens = len(TOKEN_SLOTS)
    x = randn(num_tokens, in_features, seed=seed + 2).to(dtype)
    y = randn(num_tokens, sum(part_sizes), seed=seed + 3).to(dtype)
    return y, x, torch.tensor(TOKEN_SLOTS), a, b


def delta64(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, part_sizes: tuple[int, ...]
) -> torch.Tensor:
    """The exact LoRA delta of every token in float64, written another way than the reference:
    all parts' A times x in one einsum, then each row of B against its own part's vector picked
    by a row-to-part map; zero for slot -1."""
    offsets = part_offsets(part_sizes)
    part_of_row = torch.repeat_interleave(torch.arange(len(part_sizes)), torch.tensor(part_sizes))
    out = torch.zeros(x.shape[0], offsets[-1], dtype=torch.float64)
    for t, slot in enumerate(TOKEN_SLOTS):
        if slot < 0:
            continue
        shrunk = torch.einsum("jrk,k->jr", a[slot].double(), x[t].double())  # [J, R]
        out[t] = (b[slot].double() * shrunk[part_of_row]).sum(1)
    return out


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within two bfloat16 ulps of |want| plus one ulp of the delta's size (an intermediate one
    ulp off), and at least 90% of the elements bit-identical."""
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=1e-2, rtol=2 * torch.finfo(torch.bfloat16).eps)
    same = (got == want).float().mean().item()
    assert same >= 0.9, f"only {same:.1%} of the elements are bit-identical"


# ------------------------------------------------------------------------------ group_tokens


def assert_cpu_result(got: torch.Tensor, want: torch.Tensor, y: torch.Tensor) -> None:
    """The CPU path's y against the reference's: close in its dtype, the base tokens' rows
    untouched and the adapters' rows changed."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert_bf16_close(got, want)
    assert torch.equal(got[BASE_TOKENS], y[BASE_TOKENS])
    assert not torch.equal(got[LORA_TOKENS], y[LORA_TOKENS])


def assert_groups(got: list[LoRAGroup], want: list[tuple]) -> None:
    assert len(got) == len(want)
    for group, (slot, rank, tokens) in zip(got, want, strict=True):
        assert isinstance(group, LoRAGroup)
        assert (group.slot, group.rank) == (slot, rank)
        if isinstance(tokens, slice):
            assert group.tokens == tokens
        else:
            assert isinstance(group.tokens, torch.Tensor)
            assert group.tokens.dtype == torch.int64
            assert group.tokens.tolist() == tokens


def test_group_tokens_slices_and_indices() -> None:
    groups = group_tokens(np.array(TOKEN_SLOTS), SLOT_RANKS)
    assert_groups(groups, [(0, 8, slice(1, 4)), (1, 16, [8, 10, 11, 13]), (2, 64, slice(4, 7))])


def test_group_tokens_edges() -> None:
    ranks = [4, 8, 12]
    assert group_tokens(np.array([-1, -1, -1]), ranks) == []
    assert group_tokens(np.array([], dtype=np.int64), ranks) == []
    # One token, a whole batch of one slot, and a slot whose run is broken by another slot.
    assert_groups(group_tokens(np.array([-1, 2, -1]), ranks), [(2, 12, slice(1, 2))])
    assert_groups(
        group_tokens(np.array([1, 1, 1, 1], dtype=np.int32), ranks), [(1, 8, slice(0, 4))]
    )
    assert_groups(
        group_tokens(np.array([0, 2, 0, 1, 1]), ranks),
        [(0, 4, [0, 2]), (1, 8, slice(3, 5)), (2, 12, slice(1, 2))],
    )


# ------------------------------------------------------------------------- reference itself


def test_reference_is_the_lora_sum() -> None:
    part_sizes = (64, 32, 32)
    y, x, slots, a, b = make_batch(48, part_sizes, torch.float32)
    want = y.double() + delta64(x, a, b, part_sizes)
    got = y.clone()
    lora_add_reference(got, x, slots, a, b, part_sizes)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[BASE_TOKENS], y[BASE_TOKENS])
    # Every adapter token moved by a delta of the expected size, not a rounding error.
    moved = (got[LORA_TOKENS] - y[LORA_TOKENS]).abs().amax(dim=1)
    assert bool((moved > 0.1).all()), moved


# ---------------------------------------------------------------------------- the CPU path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_matches_reference(dtype: torch.dtype) -> None:
    part_sizes = (64, 32, 32)  # q, k, v of unequal sizes
    y, x, slots, a, b = make_batch(48, part_sizes, dtype, seed=10)
    want = y.clone()
    lora_add_reference(want, x, slots, a, b, part_sizes)
    got = y.clone()
    groups = group_tokens(slots.numpy(), SLOT_RANKS)
    assert any(isinstance(g.tokens, torch.Tensor) for g in groups)  # the index path runs
    lora_add_cpu(got, x, groups, a, b, part_sizes)
    assert_cpu_result(got, want, y)


def test_cpu_reads_only_the_actual_rank() -> None:
    """NaN in every slot's rank padding, of A and of B, changes nothing: the CPU path multiplies
    only the first `rank` rows of A and columns of B (the reference, which computes the padded
    rank, would turn those rows into NaN)."""
    part_sizes = (40, 24, 24)
    y, x, slots, a, b = make_batch(32, part_sizes, torch.float32, seed=20)
    groups = group_tokens(slots.numpy(), SLOT_RANKS)
    clean = y.clone()
    lora_add_cpu(clean, x, groups, a, b, part_sizes)
    a_nan, b_nan = a.clone(), b.clone()
    for slot, rank in enumerate(SLOT_RANKS):
        a_nan[slot, :, rank:] = float("nan")
        b_nan[slot, :, rank:] = float("nan")
    assert a_nan.isnan().any() and b_nan.isnan().any()
    poisoned = y.clone()
    lora_add_cpu(poisoned, x, groups, a_nan, b_nan, part_sizes)
    assert torch.equal(poisoned, clean)
    reference = y.clone()
    lora_add_reference(reference, x, slots, a_nan, b_nan, part_sizes)
    assert reference[LORA_TOKENS[0]].isnan().all()  # slot 0 (rank 8) is padded


def test_cpu_single_part_and_no_adapter() -> None:
    """J = 1 (o_proj / down_proj), and a batch without adapters: y is left exactly as it was."""
    part_sizes = (56,)
    y, x, slots, a, b = make_batch(40, part_sizes, torch.float32, seed=30)
    want = y.clone()
    lora_add_reference(want, x, slots, a, b, part_sizes)
    got = y.clone()
    lora_add_cpu(got, x, group_tokens(slots.numpy(), SLOT_RANKS), a, b, part_sizes)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    untouched = y.clone()
    groups = group_tokens(np.full(len(TOKEN_SLOTS), -1), SLOT_RANKS)
    lora_add_cpu(untouched, x, groups, a, b, part_sizes)
    assert torch.equal(untouched, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["out-major", "slot-major"])
def test_cpu_masked_path_matches_reference(dtype: torch.dtype, layout: str) -> None:
    """The decode path: every token against every slot at the padded rank, masked. B stored
    [out, S, R] (engine/lora/layers.py's layout: each part's weight is a view) or [S, out, R]
    (read through a copy); tokens of no slot, and the unused slot 3, contribute nothing."""
    part_sizes = (64, 32, 32)
    y, x, slots, a, b = make_batch(48, part_sizes, dtype, seed=40)
    if layout == "out-major":
        b = b.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    mask = slot_mask(slots.numpy(), len(SLOT_RANKS), dtype)
    assert mask.tolist() == [
        [float(slot == s) for s in range(len(SLOT_RANKS))] for slot in TOKEN_SLOTS
    ]
    want = y.clone()
    lora_add_reference(want, x, slots, a, b, part_sizes)
    got = y.clone()
    a_flat, b_parts = dense_weights(a, b, part_sizes)
    assert (a_flat.data_ptr(), a_flat.shape) == (a.data_ptr(), (4 * 3 * MAX_RANK, 48))
    # The engine's layout gives views (no copy per step); the other, copies.
    assert (b_parts[1].data_ptr() - b.data_ptr() == 64 * 4 * MAX_RANK * b.element_size()) == (
        layout == "out-major"
    )
    lora_add_cpu_dense(got, x, mask, a_flat, b_parts)
    assert_cpu_result(got, want, y)


# ------------------------------------------------------------------------- the Triton path


@needs_interpreter
@pytest.mark.parametrize(
    ("in_features", "part_sizes", "block_n", "block_k"),
    [
        # Default tiles: a 128-row tile holds all three parts (boundaries 64 and 96 inside it).
        (48, (64, 32, 32), None, None),
        # 32-row tiles: boundaries 48 and 88 fall inside tiles 1 and 2; `in` = 72 is not a
        # multiple of the 32-wide K chunks (masked tail).
        (72, (48, 40, 40), 32, 32),
        # J = 1, out = 80 not a multiple of the tile (masked rows).
        (40, (80,), 32, 16),
    ],
)
def test_triton_matches_reference(
    in_features: int, part_sizes: tuple[int, ...], block_n: int | None, block_k: int | None
) -> None:
    y, x, slots, a, b = make_batch(in_features, part_sizes, torch.float32, seed=40)
    want = y.clone()
    lora_add_reference(want, x, slots, a, b, part_sizes)
    got = y.clone()
    lora_add_triton(got, x, slots, a, b, part_sizes, block_n=block_n, block_k=block_k)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[BASE_TOKENS], y[BASE_TOKENS])
    assert not torch.equal(got[LORA_TOKENS], y[LORA_TOKENS])


@needs_interpreter
def test_triton_bfloat16_and_strided_y() -> None:
    """bfloat16 (rounded where the reference rounds), with y a column slice of a wider output
    (the kernels take y's strides) whose other columns must stay untouched."""
    part_sizes = (48, 24, 24)
    y, x, slots, a, b = make_batch(64, part_sizes, torch.bfloat16, seed=50)
    want = y.clone()
    lora_add_reference(want, x, slots, a, b, part_sizes)
    wide = torch.cat([randn(y.shape[0], 8, seed=51).bfloat16(), y], dim=1)
    before = wide.clone()
    lora_add_triton(wide[:, 8:], x, slots, a, b, part_sizes, block_n=32)
    assert_bf16_close(wide[:, 8:], want)
    assert torch.equal(wide[:, :8], before[:, :8])
    assert torch.equal(wide[BASE_TOKENS], before[BASE_TOKENS])


def test_shape_and_dtype_errors() -> None:
    y, x, slots, a, b = make_batch(32, (40, 24, 24), torch.float32)
    with pytest.raises(ValueError, match="must sum to y's 88 columns"):
        lora_add_reference(y, x, slots, a, b, (40, 24, 20))
    with pytest.raises(ValueError, match="must be 3 sizes"):
        lora_add_reference(y, x, slots, a, b, (64, 24))
    with pytest.raises(ValueError, match="share one float dtype"):
        lora_add_reference(y, x, slots, a, b.bfloat16(), (40, 24, 24))
    with pytest.raises(ValueError, match="rank 65"):
        lora_add_cpu(y, x, [LoRAGroup(0, 65, slice(0, 2))], a, b, (40, 24, 24))
