"""Q4_0, Q4_1, Q5_0, Q8_0 and Q4_K weights kept with their rows interleaved by 8 (engine/models/
quantized_linear.py `QuantizedRows.interleave`, kernels/csrc/cpu_gguf.cpp `rows8_linear`): the
file's bytes in another order, put back exactly; the block dot products on them equal a float64
product as the file's layout does; the AMX tiles, dequantizing and embedding lookups give what
they give on the file's layout, bit for bit; other types and partial groups keep the file's
layout; steps route by the interleaved weights' own crossover. The suite runs this file at the
CPU's own level and, through tests/engine/test_lesser_cpu.py, at the avx2 level (vpmaddubsw,
Q8_0's codes made signed again).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import pagedserve.engine.models.quantized_linear as ql
from pagedserve.engine.models.quantized_linear import BlockWeight, gguf_rows
from tests import kquants
from tests.engine.test_quantized_linear import (
    _activations_as_quantized,
    needs_amx,
    needs_block_dot,
)

Q = gguf.GGMLQuantizationType
SAME_SIZE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0)  # interleaved by runs of the file's bytes
INTERLEAVED = (*SAME_SIZE, Q.Q4_K, Q.Q6_K)
N, K = 72, 160  # 9 groups of 8 rows (a pair of groups left over by one), 5 blocks of 32
K_QUANT_K = 512  # two super-blocks of 256


def _k(qtype: Q) -> int:
    return K_QUANT_K if qtype in (Q.Q4_K, Q.Q6_K) else K


def _rows(qtype: Q, n: int = N, k: int | None = None) -> ql.QuantizedRows:
    """Random blocks: every bit pattern of the codes and scales."""
    k = k or _k(qtype)
    return gguf_rows(kquants.random_blocks(qtype, n, k, seed=int(qtype)), qtype, (n, k))


def test_q4_k_groups_hold_each_blocks_scales_and_q4_0s_runs():
    rows = _rows(Q.Q4_K)
    inter = rows.interleave()
    assert inter.interleaved and inter.kernel_type == int(Q.Q4_K) + 1000
    assert inter.blocks.shape == (N // 8, K_QUANT_K // 256 * 1184)
    assert np.array_equal(inter.in_file_order(), rows.blocks.numpy())
    assert torch.equal(inter.dequantize(), rows.dequantize())
    # Group 1, super-block 1: rows 8-15's d and dmin, block j's sc_j and m_j (ggml's
    # get_scale_min_k4: j = 5 takes the high bits from byte j - 4), block 3's first run.
    group, file_rows = inter.blocks[1].numpy()[1184:], rows.blocks[8:16].numpy()[:, 144:]
    assert group[:16].tobytes() == file_rows[:, 0:2].tobytes()
    assert group[16:32].tobytes() == file_rows[:, 2:4].tobytes()
    q = file_rows[:, 4:16].astype(int)
    assert list(group[32 : 32 + 8]) == list(q[:, 0] & 63)  # sc_0
    assert list(group[32 + 5 * 16 : 32 + 5 * 16 + 8]) == list((q[:, 9] & 15) | (q[:, 1] >> 6) << 4)
    assert list(group[40 + 5 * 16 : 40 + 5 * 16 + 8]) == list((q[:, 9] >> 4) | (q[:, 5] >> 6) << 4)
    run = group[160 + 3 * 128 : 160 + 3 * 128 + 32].reshape(8, 4)  # values 0-3 low, 16-19 high
    qs = file_rows[:, 16 + 32 : 16 + 64]  # block pair 1: block 3 in the high nibbles
    assert np.array_equal(run & 15, qs[:, 0:4] >> 4) and np.array_equal(run >> 4, qs[:, 16:20] >> 4)


@pytest.mark.parametrize("qtype", SAME_SIZE)
def test_interleaving_moves_the_files_bytes_and_is_undone_exactly(qtype):
    rows = _rows(qtype)
    inter = rows.interleave()
    assert inter.interleaved and inter.kernel_type == int(qtype) + ql.ROWS8 == int(qtype) + 1000
    assert inter.blocks.shape == (N // 8, 8 * rows.blocks.shape[1])
    assert inter.blocks.nbytes == rows.blocks.nbytes
    assert np.array_equal(inter.in_file_order(), rows.blocks.numpy())
    assert torch.equal(inter.dequantize(), rows.dequantize())
    assert inter.interleave() is inter
    # Group 1, block 0: rows 8-15's float16 d (Q4_1: then their m; Q5_0: then their fifth bits),
    # then run 0 holding each row's first 4 code bytes (Q8_0's plus 128).
    group, file_rows = inter.blocks[1].numpy(), rows.blocks[8:16].numpy()
    halves = 2 if qtype == Q.Q4_1 else 1
    for h in range(halves):
        assert group[16 * h : 16 * h + 16].tobytes() == file_rows[:, 2 * h : 2 * h + 2].tobytes()
    head, codes_at = 16 * halves, 2 * halves
    if qtype == Q.Q5_0:  # byte 4 r + p, bit g: row r's fifth bit of value 4 g + p
        qh = file_rows[:, 2:6].copy().view("<u4")[:, 0]
        for r, p, g in ((0, 0, 0), (3, 1, 2), (5, 3, 7), (7, 2, 4)):
            assert (group[16 + 4 * r + p] >> g) & 1 == (int(qh[r]) >> (4 * g + p)) & 1
        head, codes_at = 48, 6
    first_codes = file_rows[:, codes_at : codes_at + 4] ^ (0x80 if qtype == Q.Q8_0 else 0)
    assert group[head : head + 32].tobytes() == first_codes.tobytes()
    # Stacking and row functions take the file's layout back.
    (stacked,) = ql.QuantizedRows.stack([inter, rows])
    assert not stacked.interleaved and torch.equal(stacked.blocks, torch.cat([rows.blocks] * 2))
    flipped = inter.select_rows(lambda a: a[::-1])
    assert not flipped.interleaved and torch.equal(flipped.blocks, rows.blocks.flip(0))
    # Rows by whole groups only.
    assert torch.equal(inter.row_blocks(8, 24), inter.blocks[1:3])
    with pytest.raises(ValueError, match="rows 4..16 of interleaved blocks must be whole groups"):
        inter.row_blocks(4, 16)


def test_other_types_and_partial_groups_keep_the_files_layout():
    for qtype, n, k in ((Q.Q5_1, 72, 64), (Q.Q5_K, 16, 256), (Q.Q4_1, 37, 64), (Q.Q8_0, 12, 64)):
        rows = _rows(qtype, n, k)
        assert rows.interleave() is rows
        weight = BlockWeight(rows)
        assert not weight.interleaved and weight.parts[0].kernel_type == int(qtype)


@needs_block_dot
@pytest.mark.parametrize("qtype", INTERLEAVED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_dots_of_interleaved_rows_equal_a_float64_product(qtype, dtype):
    """One activation row takes a pair of groups at once (the ninth group alone), 1 to 4 rows
    a group at a time, and the remainders: 1 to 9 rows."""
    inter = _rows(qtype).interleave()
    dense = inter.dequantize().double()
    for rows in range(1, 10):
        x = torch.randn(rows, _k(qtype), generator=torch.Generator().manual_seed(rows)).to(dtype)
        x[0, :32] = 0.0  # a block of zeros (dx = 0)
        expected = _activations_as_quantized(x) @ dense.T
        out = torch.full((rows, N + 3), 7.0, dtype=dtype)  # columns of wider rows
        torch.ops.pagedserve_cpu.gguf_block_linear(
            x, inter.blocks, inter.kernel_type, out[:, 1 : 1 + N]
        )
        scale = expected.abs().max().item()
        tolerance = scale * (1e-5 if dtype == torch.float32 else 2**-8)
        torch.testing.assert_close(out[:, 1 : 1 + N].double(), expected, rtol=0, atol=tolerance)
        assert (out[:, 0] == 7).all() and (out[:, 1 + N :] == 7).all()


@needs_block_dot
@pytest.mark.parametrize("qtype", INTERLEAVED)
def test_dequantizing_and_lookups_of_interleaved_rows_are_the_files_values(
    qtype, monkeypatch, batch_variant
):
    rows = _rows(qtype)
    weight = BlockWeight(rows)
    assert weight.interleaved
    values = rows.dequantize()
    assert torch.equal(weight.dequantize(), values)
    assert torch.equal(weight.dequantize(torch.bfloat16), values.bfloat16())
    ids = torch.tensor([[3, 71, 8], [0, 3, 64]])
    assert torch.equal(weight.embedding(ids, torch.float32), values[ids])
    with pytest.raises(RuntimeError, match="row 72 of a weight of 72 rows"):
        weight.embedding(torch.tensor([5, 72]), torch.float32)
    # The dense route a slab of whole groups at a time: 50 rows' budget, slabs of 48.
    x = torch.randn(40, _k(qtype))
    whole = weight.linear(x)
    monkeypatch.setattr(ql, "SCRATCH_BYTES", 50 * _k(qtype) * x.element_size())
    assert torch.equal(weight.linear(x), whole)
    torch.testing.assert_close(whole, x @ values.T)


@needs_amx
@pytest.mark.parametrize("qtype", INTERLEAVED)
def test_amx_tiles_of_interleaved_rows_equal_the_files_layout(qtype):
    """The tiles dequantize a group at a time: the same bf16 values, so the same products."""
    rows = _rows(qtype)
    inter = rows.interleave()
    amx_linear = torch.ops.pagedserve_cpu.gguf_amx_linear
    for m in (1, 16, 17, 64, 130):
        x = torch.randn(m, _k(qtype), generator=torch.Generator().manual_seed(m)).bfloat16()
        by_file, by_groups = (torch.empty(m, N, dtype=torch.bfloat16) for _ in range(2))
        amx_linear(x, rows.blocks, int(qtype), by_file)
        amx_linear(x, inter.blocks, inter.kernel_type, by_groups)
        assert torch.equal(by_groups, by_file)


@needs_block_dot
def test_interleaved_weights_route_by_their_own_crossover(monkeypatch, batch_variant):
    """With AMX, bf16 steps of up to INTERLEAVED_AMX_MIN_ROWS rows take the (faster) block dot
    products of interleaved rows, where the file's layout takes the tiles past AMX_MIN_ROWS."""
    bf16 = torch.bfloat16
    monkeypatch.setattr(ql, "amx_tiles", lambda: True)
    assert ql.AMX_MIN_ROWS < ql.INTERLEAVED_AMX_MIN_ROWS
    assert ql.route(ql.AMX_MIN_ROWS + 1, bf16) == "amx"
    assert ql.route(ql.AMX_MIN_ROWS + 1, bf16, interleaved=True) == "blocks"
    assert ql.route(ql.INTERLEAVED_AMX_MIN_ROWS, bf16, interleaved=True) == "blocks"
    assert ql.route(ql.INTERLEAVED_AMX_MIN_ROWS + 1, bf16, interleaved=True) == "amx"
    monkeypatch.setattr(ql, "amx_tiles", lambda: False)
    most = ql.BLOCK_DOT_MAX_ROWS[torch.float32]
    assert ql.route(most, torch.float32, interleaved=True) == "blocks"
    assert ql.route(most + 1, torch.float32, interleaved=True) == "dense"
    # A weight is interleaved when all its parts are.
    mixed = BlockWeight([_rows(Q.Q4_1), _rows(Q.Q5_1)])
    assert [p.interleaved for p in mixed.parts] == [True, False] and not mixed.interleaved
