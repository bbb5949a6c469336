"""The fp8 KV cache (`kernels.fp8`): quantization and its saturation, the reference attention over
fp8 caches, and the Triton kernels against the reference on the same fp8 caches.

Without a GPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set in
tests/conftest.py). q is float32 here (float16 once): the interpreter cannot compute a bf16
tl.dot, and it rounds float32 to bfloat16 by truncation; `python -m benchmarks.gpu_kernels`
checks bf16 q over an fp8 cache on the GPU.

Exactness: the cache writes are bit-equal to torch's cast for both formats (e4m3 and e5m2). The
interpreter's own float32 -> fp8 conversion is not (it drops the carry when rounding up crosses a
power of two: 7.77 -> 4.0 in e4m3, and e5m2 differs likewise), so the kernels round to the fp8
grid themselves and the conversion only sees exact values (`triton_attention.quantize_fp8`).
The attention kernels dequantize the same bytes to the same values as the reference, so they
match it to float32 tolerance, as in test_triton.py.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import replace

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import fp8, reference, triton_attention, triton_fused, triton_ops
from tests.kernels.paged_batch import MIXED, Batch, attend, dense_attention, make_batch

pytestmark = pytest.mark.skipif(
    not triton_attention.INTERPRETED,
    reason="CPU tensors need Triton's interpreter, which tests/conftest.py turns on only on "
    "machines without a GPU; on a GPU, `python -m benchmarks.gpu_kernels` checks the kernels",
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
TOL = dict(atol=1e-5, rtol=1e-5)  # float32 against float32 on the same dequantized values
DECODE = [(0, 1), (15, 1), (16, 1), (200, 1), (700, 1)]


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half an ulp relative: 2^-4 for e4m3 (3 mantissa bits), 2^-3 for e5m2 (2 bits)."""
    return torch.finfo(dtype).eps / 2


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def scale(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


def fp8_batch(
    batch: Batch, dtype: torch.dtype, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> Batch:
    """`batch` with its caches quantized to `dtype` (every slot, as reshape_and_cache would write
    it) and its dense keys/values replaced by what the cache reads back, for dense_attention."""
    return replace(
        batch,
        k_cache=fp8.quantize_kv(batch.k_cache, k_scale, dtype),
        v_cache=fp8.quantize_kv(batch.v_cache, v_scale, dtype),
        keys=[fp8.dequantize_kv(fp8.quantize_kv(k, k_scale, dtype), k_scale, k.dtype)
              for k in batch.keys],
        values=[fp8.dequantize_kv(fp8.quantize_kv(v, v_scale, dtype), v_scale, v.dtype)
                for v in batch.values],
    )  # fmt: skip


# ------------------------------------------------------------------------------- the fp8 facts


def test_the_fp8_names_and_helpers_are_exported():
    assert dict(kernels.FP8_KV_DTYPES) == {"fp8": E4M3, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}
    assert kernels.is_fp8(E4M3) and kernels.is_fp8(E5M2)
    assert not any(map(kernels.is_fp8, (torch.bfloat16, torch.float16, torch.float32)))
    assert kernels.kv_scale_from_amax is fp8.kv_scale_from_amax
    with pytest.raises(TypeError):
        kernels.FP8_KV_DTYPES["fp8"] = torch.float16  # read-only


@pytest.mark.parametrize("dtype", FP8)
def test_every_fp8_value_round_trips(dtype):
    # Every finite byte, dequantized with a power-of-two scale (exact) and quantized back.
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    codes = codes[codes.float().isfinite()]
    for s in (None, scale(0.25), scale(8.0)):
        x = fp8.dequantize_kv(codes, s, torch.float32)
        assert torch.equal(bits(fp8.quantize_kv(x, s, dtype)), bits(codes))


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_saturates_and_rounds_within_half_an_ulp(dtype):
    top = fp8.fp8_max(dtype)
    assert top == {E4M3: 448.0, E5M2: 57344.0}[dtype]
    x = torch.tensor([top, top * 1.03, top * 1.5, 1e30, float("inf"), -top * 1.03, float("-inf")])
    before = x.clone()
    c = fp8.quantize_kv(x, None, dtype)
    assert torch.equal(x, before)  # the input is left alone
    assert c.float().tolist() == [top, top, top, top, top, -top, -top]  # no NaN, no inf
    # With a scale, x / scale is what is rounded and saturated: 500 is past e4m3's 448, and
    # between e5m2's 448 and 512.
    got = fp8.quantize_kv(torch.tensor([1000.0, -1000.0]), scale(2.0), dtype).float().tolist()
    assert got == {E4M3: [448.0, -448.0], E5M2: [512.0, -512.0]}[dtype]
    # Round to nearest: |x - x'| <= u |x| over the normal range, u = half an ulp relative.
    gen = torch.Generator().manual_seed(0)
    info = torch.finfo(dtype)
    magnitudes = torch.exp2(torch.empty(10000).uniform_(
        math.log2(info.smallest_normal), math.log2(top), generator=gen))  # fmt: skip
    x = magnitudes * torch.where(torch.rand(10000, generator=gen) < 0.5, -1.0, 1.0)
    back = fp8.dequantize_kv(fp8.quantize_kv(x, None, dtype), None, torch.float32)
    assert bool(((back - x).abs() <= unit_roundoff(dtype) * x.abs()).all())
    assert not torch.equal(back, x)


def test_kv_scale_from_amax():
    for dtype, top in ((E4M3, 448.0), (E5M2, 57344.0)):
        s = kernels.kv_scale_from_amax(torch.tensor(3.5), dtype)
        assert s.dtype == torch.float32 and s.shape == (1,)
        torch.testing.assert_close(s, scale(3.5 * 2 / top))
        # amax lands at half the range: twice amax still fits without saturating.
        x = torch.tensor([3.5, -7.0, 7.0])
        assert fp8.quantize_kv(x, s, dtype).float().abs().tolist() == [top / 2, top, top]
    zero = kernels.kv_scale_from_amax(torch.zeros(1), E4M3)
    assert zero.item() == fp8.MIN_KV_SCALE > 0  # an all-zero calibration: no division by 0
    assert fp8.quantize_kv(torch.ones(3), zero, E4M3).float().isfinite().all()
    with pytest.raises(ValueError, match="amax must hold one value"):
        kernels.kv_scale_from_amax(torch.ones(2), E4M3)


# ------------------------------------------------------------------------ reference attention


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_reference_over_fp8_equals_float32_over_the_dequantized_values(dtype, seqs):
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, seed=3)
    k_scale, v_scale = scale(0.02), scale(0.5)  # keys land at up to ~200, values at up to ~8
    quant = fp8_batch(batch, dtype, k_scale, v_scale)
    dequant = replace(
        quant,
        k_cache=fp8.dequantize_kv(quant.k_cache, k_scale, torch.float32),
        v_cache=fp8.dequantize_kv(quant.v_cache, v_scale, torch.float32),
    )
    for window in (None, 20):
        got = attend(reference, quant, 0.125, k_scale=k_scale, v_scale=v_scale,
                     sliding_window=window)  # fmt: skip
        # The same values in the same SDPA calls: equal, not merely close.
        assert torch.equal(got, attend(reference, dequant, 0.125, sliding_window=window))
        torch.testing.assert_close(got, dense_attention(quant, 0.125, window).float(), **TOL)
    # In float16, the gathered values are dequantized straight to q's dtype.
    q16 = replace(quant, q=quant.q.half())
    got16 = attend(reference, q16, 0.125, k_scale=k_scale, v_scale=v_scale)
    dequant16 = replace(dequant, q=q16.q, k_cache=dequant.k_cache.half(),
                        v_cache=dequant.v_cache.half())  # fmt: skip
    assert got16.dtype == torch.float16
    assert torch.equal(got16, attend(reference, dequant16, 0.125))


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_reference_over_fp8_is_close_to_the_unquantized_attention(dtype, seqs):
    # Scales calibrated as the engine would (kv_scale_from_amax over the cache), float32 q,
    # against float64 attention over the unquantized keys and values.
    #
    # Bound, with u the fp8 unit roundoff (2^-4 e4m3, 2^-3 e5m2): each dequantized value is
    # within u of its own magnitude, so the output, a weighted mean of values, moves by up to
    # u |v| from the values, plus what the keys' error does to the weights. Measured over 30
    # seeds of these two batches: max |err| / (u (1 + |want|)) = 2.12 (e4m3) and 1.86 (e5m2);
    # mean |err| / u = 0.19 and 0.18 (0.012 and 0.023 absolute). Asserted: 2.5 and 0.25; and the
    # error is not zero (a test that cannot fail is no test).
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, seed=0)
    k_scale = kernels.kv_scale_from_amax(batch.k_cache.abs().amax(), dtype)
    v_scale = kernels.kv_scale_from_amax(batch.v_cache.abs().amax(), dtype)
    quant = fp8_batch(batch, dtype, k_scale, v_scale)
    got = attend(reference, quant, 0.125, k_scale=k_scale, v_scale=v_scale)
    want = dense_attention(batch, 0.125).float()
    u = unit_roundoff(dtype)
    err = (got - want).abs()
    assert bool((err <= 2.5 * u * (1 + want.abs())).all()), float((err / (1 + want.abs())).max())
    assert 0.05 * u < float(err.mean()) <= 0.25 * u


# ----------------------------------------------------------------------- Triton: cache writes


def awkward_values(num_tokens: int, num_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    """float32 values over every fp8 binade and past the range: random magnitudes from 2^-24 to
    2^20, exact ties between fp8 neighbours (round to even), values just below a power of two
    (the round-up carries into the exponent), zeros of both signs, infinities."""
    gen = torch.Generator().manual_seed(seed)
    n = num_tokens * num_heads * head_dim
    x = torch.exp2(torch.empty(n).uniform_(-24, 20, generator=gen))
    x *= torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 7.77, 31.9, -1.99, 0.0146])
    # Midpoints between neighbouring e4m3 and e5m2 values (both grids, at several binades).
    grid = torch.arange(256, dtype=torch.uint8)
    ties = []
    for dtype in FP8:
        v = grid.view(dtype).float()
        v = v[v.isfinite() & (v > 0)].sort().values
        ties.append((v[1:] + v[:-1]) / 2)
    ties = torch.cat(ties)
    x[: special.numel()] = special
    x[special.numel() : special.numel() + ties.numel()] = ties
    return x.view(num_tokens, num_heads, head_dim)


# Each input dtype once and each fp8 format at least once in `make test` (2 s a case under the
# interpreter); the rest of the grid with `make test-slow`.
@pytest.mark.parametrize(
    ("x_dtype", "dtype"),
    [
        (torch.float32, torch.float8_e4m3fn),
        (torch.float16, torch.float8_e5m2),
        (torch.bfloat16, torch.float8_e4m3fn),
        pytest.param(torch.float32, torch.float8_e5m2, marks=pytest.mark.slow),
        pytest.param(torch.float16, torch.float8_e4m3fn, marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, torch.float8_e5m2, marks=pytest.mark.slow),
    ],
)
def test_reshape_and_cache_into_fp8_is_bit_equal_to_the_reference(dtype, x_dtype):
    num_blocks, block_size, heads, dim = 10, 8, 2, 64
    key = awkward_values(72, heads, dim, seed=1).to(x_dtype)
    value = -awkward_values(72, heads, dim, seed=2).flip(0).to(x_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(0))
    slots = slots[:72].clone()
    slots[[5, 40]] = -1  # padding
    for k_scale, v_scale in ((None, None), (scale(0.37), scale(3.0)), (scale(1e-3), None)):
        want = [torch.zeros(num_blocks, block_size, heads, dim, dtype=dtype) for _ in range(2)]
        got = [c.clone() for c in want]
        reference.reshape_and_cache(key, value, *want, slots, k_scale=k_scale, v_scale=v_scale)
        triton_attention.reshape_and_cache(key, value, *got, slots, k_scale=k_scale,
                                           v_scale=v_scale)  # fmt: skip
        for g, w in zip(got, want, strict=True):
            assert torch.equal(bits(g), bits(w))
            assert not w.float().isnan().any()
        assert float(want[0].float().abs().max()) == fp8.fp8_max(dtype)  # saturated, no NaN
    # The written slot holds key / scale: slot 7 of the permutation is token 7's.
    assert torch.equal(bits(want[0].view(-1, heads, dim)[slots[7]]),
                       bits(fp8.quantize_kv(key[7], k_scale, dtype)))  # fmt: skip


@pytest.mark.parametrize("dtype", FP8)
def test_rotary_and_cache_into_fp8_is_bit_equal_to_the_reference(dtype):
    from pagedserve.engine.models.rotary import RotaryEmbedding

    num_heads, num_kv_heads, head_dim, num_tokens = 6, 2, 64, 9
    rotary = RotaryEmbedding(head_dim, 256, 10000.0)
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3
    positions = torch.randint(0, 256, (num_tokens,), generator=gen)
    slots = torch.randperm(32, generator=gen)[:num_tokens].clone()
    slots[2] = -1
    heads = (num_heads, num_kv_heads, head_dim)
    for k_scale, v_scale in ((None, None), (scale(0.01), scale(0.05))):
        want = [torch.zeros(4, 8, num_kv_heads, head_dim, dtype=dtype) for _ in range(2)]
        got = [c.clone() for c in want]
        tables = (rotary.cos, rotary.sin)
        q_want = reference.rotary_and_cache(qkv, positions, *tables, *want, slots, *heads,
                                            k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        q_got = triton_fused.rotary_and_cache(qkv, positions, *tables, *got, slots, *heads,
                                              k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        torch.testing.assert_close(q_got, q_want, atol=1e-6, rtol=1e-6)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(bits(g), bits(w))
        assert int(bits(want[0]).count_nonzero()) > 0.9 * (num_tokens - 1) * num_kv_heads * 64


@pytest.mark.parametrize("dtype", FP8)
def test_copy_blocks_copies_fp8_bytes_in_both_backends(dtype):
    gen = torch.Generator().manual_seed(0)
    start = [fp8.quantize_kv(torch.randn(7, 4, 2, 16, generator=gen) * 100, None, dtype)
             for _ in range(4)]  # fmt: skip
    src, dst = torch.tensor([0, 5, 3]), torch.tensor([2, 1, 6])
    for op in (reference.copy_blocks, triton_attention.copy_blocks):
        caches = [c.clone() for c in start]
        op(caches, src, dst)
        for before, after in zip(start, caches, strict=True):
            assert after.dtype == dtype
            assert torch.equal(bits(after[[2, 1, 6]]), bits(before[[0, 5, 3]]))
            assert torch.equal(bits(after[[0, 3, 4, 5]]), bits(before[[0, 3, 4, 5]]))


# --------------------------------------------------------------------- Triton: paged attention


# e4m3 with every head layout; e5m2 with SmolLM2's in `make test`, the others with test-slow.
@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads"),
    [
        (torch.float8_e4m3fn, 4, 4),
        (torch.float8_e4m3fn, 9, 3),
        (torch.float8_e4m3fn, 8, 1),
        (torch.float8_e5m2, 9, 3),
        pytest.param(torch.float8_e5m2, 4, 4, marks=pytest.mark.slow),
        pytest.param(torch.float8_e5m2, 8, 1, marks=pytest.mark.slow),
    ],
)
def test_triton_decode_over_fp8_matches_the_reference(dtype, num_heads, num_kv_heads):
    batch = make_batch(DECODE, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                       block_size=16, seed=num_heads)  # fmt: skip
    k_scale, v_scale = scale(0.03), scale(0.25)
    quant = fp8_batch(batch, dtype, k_scale, v_scale)
    kw = dict(k_scale=k_scale, v_scale=v_scale)
    want = attend(reference, quant, 0.125, **kw)
    torch.testing.assert_close(attend(triton_attention, quant, 0.125, **kw), want, **TOL)
    torch.testing.assert_close(want, dense_attention(quant, 0.125).float(), **TOL)
    # The split-context path, forced, with a sliding window too.
    for window, num_splits in ((None, 3), (100, 4)):
        out = torch.full_like(quant.q, float("nan"))
        triton_attention.decode(
            quant.q, quant.k_cache, quant.v_cache, quant.block_tables, quant.seq_lens,
            quant.query_start_loc, 0.125, window, out, num_splits, **kw,
        )  # fmt: skip
        ref = attend(reference, quant, 0.125, sliding_window=window, **kw)
        torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("sliding_window", [None, 11])
def test_triton_extend_over_fp8_matches_the_reference(dtype, sliding_window):
    batch = make_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=64, block_size=8, seed=7)
    k_scale, v_scale = scale(0.02), scale(0.4)
    quant = fp8_batch(batch, dtype, k_scale, v_scale)
    kw = dict(k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window)
    got = attend(triton_attention, quant, 0.125, **kw)
    torch.testing.assert_close(got, attend(reference, quant, 0.125, **kw), **TOL)
    torch.testing.assert_close(got, dense_attention(quant, 0.125, sliding_window).float(), **TOL)


def test_triton_over_fp8_without_scales_with_softcap_and_in_float16():
    # No scales (1.0), one scale only, soft-capping, and float16 q (the interpreter's fp16 dot):
    # fp16 rounds q, the dequantized K/V and P to 11 bits, hence 5e-3 as in test_triton.py.
    batch = make_batch(DECODE + [(3, 6)], num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=16, seed=11)  # fmt: skip
    quant = fp8_batch(batch, E4M3, None, None)
    for kw in ({}, {"softcap": 2.0}):
        got = attend(triton_attention, quant, 0.3, **kw)
        torch.testing.assert_close(got, attend(reference, quant, 0.3, **kw), **TOL)
    quant = fp8_batch(batch, E4M3, None, scale(0.1))
    got = attend(triton_attention, quant, 0.125, v_scale=scale(0.1))
    torch.testing.assert_close(got, attend(reference, quant, 0.125, v_scale=scale(0.1)), **TOL)
    half = replace(quant, q=quant.q.half())
    got = attend(triton_attention, half, 0.125, v_scale=scale(0.1))
    assert got.dtype == torch.float16
    want = attend(reference, half, 0.125, v_scale=scale(0.1))
    torch.testing.assert_close(got.float(), want.float(), atol=5e-3, rtol=5e-3)


class HostUnreadable(torch.Tensor):
    """A scale the host must never read: the kernels take it by pointer."""

    def item(self):
        raise AssertionError("a kernel wrapper read the scale on the host")

    def tolist(self):
        raise AssertionError("a kernel wrapper read the scale on the host")

    def __float__(self):
        raise AssertionError("a kernel wrapper read the scale on the host")


def test_scales_are_read_from_memory_at_every_call():
    # The engine calibrates the scales in place after CUDA graphs captured the kernels: a wrapper
    # must pass the tensor, never its value, and a changed value must change the next result.
    batch = make_batch(DECODE, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=2)
    k_scale = scale(0.05).as_subclass(HostUnreadable)
    v_scale = scale(0.5).as_subclass(HostUnreadable)
    quant = fp8_batch(batch, E4M3, scale(0.05), scale(0.5))
    out = torch.empty_like(quant.q)
    key = value = torch.randn(1, 2, 64)
    for _ in range(2):
        triton_attention.paged_attention(
            quant.q, quant.k_cache, quant.v_cache, quant.block_tables, quant.seq_lens,
            quant.query_start_loc, 0.125, out=out, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        plain = (scale(float(k_scale.as_subclass(torch.Tensor))),
                 scale(float(v_scale.as_subclass(torch.Tensor))))  # fmt: skip
        want = attend(reference, quant, 0.125, k_scale=plain[0], v_scale=plain[1])
        torch.testing.assert_close(out, want, **TOL)
        k_scale.mul_(2)  # in place, as calibration does
        v_scale.mul_(0.5)
    k_cache, v_cache = (torch.zeros(2, 4, 2, 64, dtype=E4M3) for _ in range(2))
    triton_attention.reshape_and_cache(key, value, k_cache, v_cache, torch.tensor([1]),
                                       k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    assert torch.equal(bits(k_cache[0, 1]), bits(fp8.quantize_kv(key[0], scale(0.2), E4M3)))


# ------------------------------------------------------------------ signatures and validation


def test_both_backends_and_the_dispatcher_take_the_scales(monkeypatch):
    for name in ("paged_attention", "reshape_and_cache", "rotary_and_cache"):
        ref = getattr(reference, name)
        params = inspect.signature(ref).parameters
        assert params["k_scale"].kind is params["k_scale"].KEYWORD_ONLY, name
        assert params["k_scale"].default is None and params["v_scale"].default is None
        ops_params = inspect.signature(getattr(triton_ops, name)).parameters
        assert ops_params == params, name
    batch = make_batch(DECODE, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=5)
    quant = fp8_batch(batch, E5M2, scale(0.1), scale(0.2))
    kw = dict(k_scale=scale(0.1), v_scale=scale(0.2))
    want = attend(reference, quant, 0.125, **kw)
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    assert torch.equal(attend(kernels, quant, 0.125, **kw), want)  # the torch backend
    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    torch.testing.assert_close(attend(kernels, quant, 0.125, **kw), want, **TOL)


@pytest.mark.parametrize("ops", [reference, triton_ops], ids=["torch", "triton"])
def test_validation_of_fp8_caches_and_scales(ops):
    batch = make_batch([(3, 2)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    quant = fp8_batch(batch, E4M3, None, None)
    kv = torch.zeros(1, 1, 64)
    slot = torch.tensor([0])
    # Any float q / key dtype with an fp8 cache.
    for dtype in (torch.float32, torch.float16):
        ops.reshape_and_cache(kv.to(dtype), kv.to(dtype), quant.k_cache, quant.v_cache, slot,
                              k_scale=scale(1.0), v_scale=scale(1.0))  # fmt: skip
    bf16 = quant.k_cache.to(torch.bfloat16)
    cases = [
        (dict(k_scale=scale(1.0)), bf16, "k_scale is given but the cache is torch.bfloat16"),
        (dict(v_scale=torch.ones(1, dtype=torch.float64)), quant.k_cache,
         r"v_scale must be a float32 tensor of shape \[1\], got torch.float64"),
        (dict(k_scale=torch.ones(())), quant.k_cache, r"got torch.float32 \(\)"),
        (dict(k_scale=0.5), quant.k_cache, "k_scale must be a float32 tensor .* got float"),
        (dict(k_scale=torch.ones(1, device="meta")), quant.k_cache,
         "k_scale is on meta, but the cache is on cpu"),
    ]  # fmt: skip
    for kwargs, cache, message in cases:
        with pytest.raises(ValueError, match=message):
            ops.reshape_and_cache(kv.to(cache.dtype) if cache.dtype == torch.bfloat16 else kv,
                                  kv.to(cache.dtype) if cache.dtype == torch.bfloat16 else kv,
                                  cache, cache.clone(), slot, **kwargs)  # fmt: skip
        with pytest.raises(ValueError, match=message):
            q = quant.q.to(torch.bfloat16) if cache.dtype == torch.bfloat16 else quant.q
            ops.paged_attention(q, cache, cache.clone(), quant.block_tables, quant.seq_lens,
                                quant.query_start_loc, 0.125, **kwargs)  # fmt: skip
    with pytest.raises(ValueError, match="q must be float32, bfloat16 or float16 with an fp8"):
        ops.paged_attention(quant.q.to(E4M3), quant.k_cache, quant.v_cache, quant.block_tables,
                            quant.seq_lens, quant.query_start_loc, 0.125)  # fmt: skip
    with pytest.raises(ValueError, match="value dtype torch.float16 differs from key dtype"):
        ops.reshape_and_cache(kv, kv.half(), quant.k_cache, quant.v_cache, slot)
