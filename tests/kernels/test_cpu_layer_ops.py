"""The cpu backend's compiled layer ops (kernels/csrc/cpu_layer_ops.cpp through `kernels.cpu_ops`):
RMSNorm, residual add + RMSNorm, SiLU-and-multiply and rotary + KV write against the torch
reference, on the grid the Triton twins are tested on (tests/kernels/test_fused.py, whose helpers
and tolerance this reuses: float32 within 1e-6, float16 and bfloat16 within two ulps and equal in
all but a few elements), plus bfloat16, which real CPUs round as torch does, and batches large
enough to be split over threads. fp8 caches and machines without the compiled library use the
reference.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import cpu_ops, reference
from tests.kernels.test_fused import (
    EPS,
    MAX_POSITIONS,
    ROTARY_HEADS,
    SENTINEL,
    assert_matches,
    randn,
    rotary_inputs,
    rotary_tables,
    sentinel_caches,
)

pytestmark = pytest.mark.skipif(
    not cpu_ops.available(), reason="no C++ compiler here: the cpu backend is the reference"
)
OPS = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_and_cache"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [64, 576, 896, 2048]
NUM_TOKENS = [1, 3, 17, 300]  # 300 rows of 576+ elements: split over threads


def test_signatures_are_the_references():
    for name in OPS:
        assert inspect.signature(getattr(cpu_ops, name)) == inspect.signature(
            getattr(reference, name)
        ), name
        assert name in cpu_ops.__all__


@pytest.mark.parametrize("unit_offset", [False, True])  # Gemma's: 1 + weight, rounded once
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden", SIZES)
def test_norms_match_the_reference(hidden, num_tokens, dtype, unit_offset):
    x = randn(num_tokens, hidden, dtype=dtype, seed=hidden + num_tokens, scale=3.0)
    residual = randn(num_tokens, hidden, dtype=dtype, seed=hidden - num_tokens, scale=4.0)
    weight = randn(hidden, dtype=dtype, seed=hidden, scale=0.3 if unit_offset else 1.0)
    kw = {"unit_offset": unit_offset}
    assert_matches(cpu_ops.rms_norm(x, weight, EPS, **kw), reference.rms_norm(x, weight, EPS, **kw))
    x_before, residual_before, ref_residual = x.clone(), residual.clone(), residual.clone()
    out, residual_out = cpu_ops.fused_add_rms_norm(x, residual, weight, EPS, **kw)
    want, _ = reference.fused_add_rms_norm(x, ref_residual, weight, EPS, **kw)
    assert residual_out is residual
    assert torch.equal(residual, x_before + residual_before) and torch.equal(x, x_before)
    assert_matches(out, want)


def test_norms_of_strided_rows_and_a_zero_row():
    wide = randn(5, 160, dtype=torch.bfloat16, seed=1)
    wide[2] = 0
    x = wide[:, :96]
    weight = randn(96, dtype=torch.bfloat16, seed=2)
    got = cpu_ops.rms_norm(x, weight, EPS)
    assert got.is_contiguous() and torch.equal(got[2], torch.zeros(96, dtype=torch.bfloat16))
    assert_matches(got, reference.rms_norm(x, weight, EPS))
    rows = randn(5, 160, dtype=torch.bfloat16, seed=3)
    ref_rows = rows.clone()
    out, _ = cpu_ops.fused_add_rms_norm(x, rows[:, 32:128], weight, EPS)
    want, _ = reference.fused_add_rms_norm(x, ref_rows[:, 32:128], weight, EPS)
    assert_matches(out, want)
    assert torch.equal(rows, ref_rows)  # columns outside the view untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("intermediate", SIZES)
def test_silu_and_mul_matches_the_reference(intermediate, num_tokens, dtype):
    gate_up = randn(num_tokens, 2 * intermediate, dtype=dtype, seed=intermediate, scale=4.0)
    got = cpu_ops.silu_and_mul(gate_up)
    assert got.shape == (num_tokens, intermediate) and got.is_contiguous()
    assert_matches(got, reference.silu_and_mul(gate_up))
    strided = randn(3, 2 * intermediate + 8, dtype=dtype, seed=5)[:, : 2 * intermediate]
    assert_matches(cpu_ops.silu_and_mul(strided), reference.silu_and_mul(strided))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_at_the_ends_of_the_range(dtype):
    big = torch.finfo(dtype).max
    gate = torch.tensor([[-big, -100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, big]], dtype=dtype)
    up = torch.tensor([[3.0, 3.0, -2.0, 5.0, 7.0, 5.0, -2.0, 3.0, 2.0]], dtype=dtype)
    gate_up = torch.cat([gate, up], dim=1)
    got, want = cpu_ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)
    assert torch.equal(got.isinf(), want.isinf()) and got[0, -1] == float("inf")
    finite = want.isfinite()
    assert_matches(got[finite], want[finite])
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 where the reference has it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_tokens", [1, 3, 17, 200])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), ROTARY_HEADS)
def test_rotary_and_cache_matches_the_reference(
    num_heads, num_kv_heads, head_dim, num_tokens, block_size, dtype
):
    rotary = rotary_tables(head_dim)
    qkv, positions, slot_mapping, num_blocks = rotary_inputs(
        num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=num_heads + head_dim
    )
    k_cache, v_cache, ref_k, ref_v = sentinel_caches(
        num_blocks, block_size, num_kv_heads, head_dim, dtype, copies=4
    )
    tables, heads = (rotary.cos, rotary.sin), (num_heads, num_kv_heads, head_dim)
    qkv_before = qkv.clone()
    q = cpu_ops.rotary_and_cache(qkv, positions, *tables, k_cache, v_cache, slot_mapping, *heads)
    want = reference.rotary_and_cache(qkv, positions, *tables, ref_k, ref_v, slot_mapping, *heads)
    assert q.shape == (num_tokens, num_heads, head_dim) and q.is_contiguous()
    assert_matches(q, want)
    assert_matches(k_cache, ref_k)  # padding slots untouched: both still hold the sentinel
    assert torch.equal(v_cache, ref_v)
    assert torch.equal(qkv, qkv_before)


def test_rotary_and_cache_refuses_what_the_reference_refuses_before_writing():
    rotary = rotary_tables(64)
    qkv = randn(2, (2 + 2 * 1) * 64, dtype=torch.bfloat16, seed=9)
    k_cache, v_cache = sentinel_caches(2, 4, 1, 64, torch.bfloat16, copies=2)
    args = (rotary.cos, rotary.sin, k_cache, v_cache)
    with pytest.raises(
        ValueError, match=r"holds slot 8, but the cache has only 8 slots \(2 blocks"
    ):
        cpu_ops.rotary_and_cache(qkv, torch.tensor([3, 4]), *args, torch.tensor([0, 8]), 2, 1, 64)
    with pytest.raises(IndexError, match=f"index {MAX_POSITIONS} is out of bounds"):
        cpu_ops.rotary_and_cache(
            qkv, torch.tensor([MAX_POSITIONS, 0]), *args, torch.tensor([1, 0]), 2, 1, 64
        )
    assert bool((k_cache == SENTINEL).all() and (v_cache == SENTINEL).all())
    # A negative position counts from the table's end, as indexing does in the reference.
    ref_k, ref_v = sentinel_caches(2, 4, 1, 64, torch.bfloat16, copies=2)
    got = cpu_ops.rotary_and_cache(
        qkv, torch.tensor([-1, 5]), *args, torch.tensor([1, 6]), 2, 1, 64
    )
    want = reference.rotary_and_cache(
        qkv, torch.tensor([-1, 5]), rotary.cos, rotary.sin, ref_k, ref_v, torch.tensor([1, 6]),
        2, 1, 64,
    )  # fmt: skip
    assert_matches(got, want)
    assert_matches(k_cache, ref_k)


def test_fp8_caches_and_a_missing_library_use_the_reference(monkeypatch):
    calls = []
    real = reference.rotary_and_cache
    monkeypatch.setattr(
        reference, "rotary_and_cache", lambda *a, **kw: calls.append(a[4].dtype) or real(*a, **kw)
    )
    rotary = rotary_tables(64)
    qkv = randn(1, (2 + 2 * 1) * 64, dtype=torch.bfloat16, seed=1)
    fp8 = torch.zeros(2, 4, 1, 64, dtype=torch.float8_e4m3fn)
    one = torch.ones(1)
    cpu_ops.rotary_and_cache(qkv, torch.tensor([3]), rotary.cos, rotary.sin, fp8, fp8.clone(),
                             torch.tensor([2]), 2, 1, 64, k_scale=one, v_scale=one)  # fmt: skip
    assert calls == [torch.float8_e4m3fn]
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    spied = []
    monkeypatch.setattr(reference, "rms_norm", lambda *a, **kw: spied.append("rms_norm") or "ref")
    assert cpu_ops.rms_norm(qkv, torch.ones(384, dtype=torch.bfloat16), EPS) == "ref"
    assert spied == ["rms_norm"]


def test_the_cpu_backend_is_the_models_ops_on_cpu():
    assert kernels.get_backend("cpu") is cpu_ops
    for name in OPS:
        assert getattr(cpu_ops, name) is not getattr(reference, name), name


def test_greedy_pick_is_torch_max_with_the_finite_check():
    # The sampler's greedy rows (engine/worker/sampler.py): the first index of each row's largest
    # value, and rows holding a NaN, +inf or -inf anywhere flagged, with id 0.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(70, 49152, generator=gen) * 5
    logits[3, [17, 40_000]] = 100.0  # a tie: the first index wins
    logits[5, 123] = float("nan")
    logits[6, 9] = float("inf")
    logits[7, 49151] = float("-inf")
    logits[8, :] = float("-inf")
    ids, finite = cpu_ops.greedy_pick(logits)
    assert ids.dtype == torch.int64 and finite.dtype == torch.bool
    bad = [5, 6, 7, 8]
    assert finite.tolist() == [i not in bad for i in range(70)]
    want = logits.max(dim=-1).indices.masked_fill(~finite, 0)
    assert torch.equal(ids, want) and ids[3] == 17 and ids[bad].tolist() == [0] * 4
    # Strided rows (a slice of wider logits) and a single row.
    wide = torch.randn(4, 1000, generator=gen)
    assert torch.equal(cpu_ops.greedy_pick(wide[:, :900])[0], wide[:, :900].argmax(dim=-1))
    assert cpu_ops.greedy_pick(wide[2:3])[0].tolist() == [int(wide[2].argmax())]
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.greedy_pick(wide.bfloat16())


def test_temperature_pick_draws_as_the_samplers_inverse_cdf():
    # The sampler's rows that sample by temperature alone (engine/worker/sampler.py): the token
    # `inverse_cdf_sample` picks from softmax(logits / T) with the same uniform, chunks of 1024
    # over a vocabulary of 49152 + 7 (a partial last chunk); rows not all finite get id 0.
    from pagedserve.engine.worker.sampler import inverse_cdf_sample

    gen = torch.Generator().manual_seed(0)
    rows, vocab = 400, 49159
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temps = [0.25, 0.7, 1.0, 1.5, 3.0] * (rows // 5)
    uniforms = torch.rand(rows, generator=gen, dtype=torch.float64)
    uniforms[:4] = torch.tensor([0.0, 1e-12, 0.5, 1.0 - 1e-12], dtype=torch.float64)
    logits[10, 5] = float("nan")
    logits[11, 49158] = float("-inf")
    ids, finite = cpu_ops.temperature_pick(logits, temps, uniforms)
    assert ids.dtype == torch.int64 and finite.tolist() == [i not in (10, 11) for i in range(rows)]
    assert ids[[10, 11]].tolist() == [0, 0]
    probs = (logits / torch.tensor(temps).unsqueeze(1)).softmax(dim=-1)
    want = inverse_cdf_sample(probs, uniforms)
    ok = finite.nonzero().squeeze(1)
    # The same token, rounding apart: the weights exp((x - max) / T) and softmax(x / T) differ in
    # the last bits, so a uniform within that of a boundary takes the neighbour (1 row of 398
    # here, 39695 against 39696: probabilities of 9e-7 and 6e-8).
    same = ids[ok] == want[ok]
    assert same.sum() >= len(ok) - 2 and (ids[ok] - want[ok]).abs().max() <= 1
    # u = 0 takes the first token of any weight, u just under 1 the last.
    assert ids[0] == 0 and ids[3] == int((probs[3] > 0).nonzero().max())
    # Strided rows and bad arguments.
    wide = torch.randn(3, 1100, generator=gen)
    u = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    got, _ = cpu_ops.temperature_pick(wide[:, :1000], [1.0] * 3, u)
    assert torch.equal(got, inverse_cdf_sample(wide[:, :1000].softmax(dim=-1), u))
    with pytest.raises(RuntimeError, match="temperatures must be positive"):
        cpu_ops.temperature_pick(wide, [1.0, 0.0, 1.0], u)
