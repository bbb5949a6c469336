"""The fused decoder-layer ops: the Triton kernels (kernels.triton_fused) against the torch
reference (kernels.reference), and the reference against the model's own code
(engine/models/model.py, engine/models/rotary.py), so the engine can switch to either without
changing a token.

Without a GPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set in
tests/conftest.py). Dtypes: float32 and float16. bfloat16 is checked on the GPU by
`python -m benchmarks.gpu_kernels --only fused`: the interpreter converts float32 to
bfloat16 by truncation, not to nearest, so its bf16 results differ from torch's by an ulp at
every rounding.

Tolerance (`assert_matches`): float32 within 1e-6 (the kernels sum and exponentiate in another
order than torch); float16 within two ulps of the result and bit-identical in all but a few
elements, which shows the kernels round where the reference rounds (rounding once at the end
instead changes 5-30% of them).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from pagedserve.engine.models.rotary import RotaryEmbedding
from pagedserve.kernels import reference, triton_attention, triton_fused

pytestmark = pytest.mark.skipif(
    not triton_attention.INTERPRETED,
    reason="CPU tensors need Triton's interpreter, which tests/conftest.py turns on only on "
    "machines without a GPU; on a GPU, `python -m benchmarks.gpu_kernels --only fused` "
    "checks the kernels",
)

OPS = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_and_cache"]
BACKENDS = [reference, triton_fused]
DTYPES = [torch.float32, torch.float16]
SIZES = [64, 576, 896, 2048]  # 896 (Qwen2-0.5B) and 576 (SmolLM2) are not powers of two
NUM_TOKENS = [1, 3, 17]
EPS = 1e-5
MAX_POSITIONS = 4096
SENTINEL = -7.5  # exact in every float dtype: cache slots that must stay untouched hold it


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: |got - want| <= 1e-6 (1 + |want|). float16: within two ulps (the machine epsilon
    is at least one ulp at any normal magnitude; atol one subnormal ulp): an intermediate the
    reference rounds (silu, the normalised x) may land one ulp off, and the product with up or
    the weight scales that to up to two ulps of the result. And at most 1% of the elements (5 in
    small tensors) differ at all."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        return
    info = torch.finfo(got.dtype)
    torch.testing.assert_close(got, want, atol=info.smallest_normal * info.eps, rtol=2 * info.eps)
    differing = int((got != want).sum())
    assert differing <= max(5, want.numel() // 100), f"{differing} of {want.numel()} differ"


def test_both_backends_have_the_same_signatures():
    for name in OPS:
        ref, fused = getattr(reference, name), getattr(triton_fused, name)
        assert inspect.signature(ref) == inspect.signature(fused), name
        assert name in reference.__all__ and name in triton_fused.__all__


# ------------------------------------------------------------------------------------ RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden", SIZES)
def test_rms_norm_matches_reference(hidden, num_tokens, dtype):
    x = randn(num_tokens, hidden, dtype=dtype, seed=hidden + num_tokens, scale=3.0)
    weight = randn(hidden, dtype=dtype, seed=hidden)
    got = triton_fused.rms_norm(x, weight, EPS)
    assert_matches(got, reference.rms_norm(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden", SIZES)
def test_fused_add_rms_norm_matches_reference(hidden, num_tokens, dtype):
    x = randn(num_tokens, hidden, dtype=dtype, seed=hidden + num_tokens)
    residual = randn(num_tokens, hidden, dtype=dtype, seed=hidden - num_tokens, scale=4.0)
    weight = randn(hidden, dtype=dtype, seed=hidden)
    x_before, residual_before = x.clone(), residual.clone()
    ref_residual = residual.clone()

    out, residual_out = triton_fused.fused_add_rms_norm(x, residual, weight, EPS)
    want, ref_residual_out = reference.fused_add_rms_norm(x, ref_residual, weight, EPS)

    # Both update the residual in place to x + residual, rounded once like torch's sum.
    assert residual_out is residual and ref_residual_out is ref_residual
    assert torch.equal(residual, x_before + residual_before)
    assert torch.equal(ref_residual, residual)
    assert torch.equal(x, x_before)
    assert_matches(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 896])
def test_unit_offset_norms_match_reference(hidden, dtype):
    # Gemma's norm: (1 + weight) in float32, rounded once; weights near 0 as Gemma stores them.
    x = randn(3, hidden, dtype=dtype, seed=hidden, scale=3.0)
    residual = randn(3, hidden, dtype=dtype, seed=hidden + 1)
    weight = randn(hidden, dtype=dtype, seed=hidden + 2, scale=0.3)
    got = triton_fused.rms_norm(x, weight, EPS, unit_offset=True)
    assert_matches(got, reference.rms_norm(x, weight, EPS, unit_offset=True))
    ref_residual = residual.clone()
    out, _ = triton_fused.fused_add_rms_norm(x, residual, weight, EPS, unit_offset=True)
    want, _ = reference.fused_add_rms_norm(x, ref_residual, weight, EPS, unit_offset=True)
    assert torch.equal(residual, ref_residual)
    assert_matches(out, want)


def test_rms_norm_of_strided_rows_and_a_zero_row():
    # Rows of a wider tensor (stride 160 for 96 columns); an all-zero row normalises to 0, not
    # NaN (eps keeps the rsqrt finite).
    wide = randn(5, 160, dtype=torch.float32, seed=1)
    wide[2] = 0
    x = wide[:, :96]
    weight = randn(96, dtype=torch.float32, seed=2)
    got = triton_fused.rms_norm(x, weight, EPS)
    assert got.is_contiguous()
    assert_matches(got, reference.rms_norm(x, weight, EPS))
    assert torch.equal(got[2], torch.zeros(96))
    residual_rows = randn(5, 160, dtype=torch.float32, seed=3)
    ref_rows = residual_rows.clone()
    out, _ = triton_fused.fused_add_rms_norm(x, residual_rows[:, 32:128], weight, EPS)
    want, _ = reference.fused_add_rms_norm(x, ref_rows[:, 32:128], weight, EPS)
    assert_matches(out, want)
    assert torch.equal(residual_rows, ref_rows)  # columns outside the view untouched


# ------------------------------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("intermediate", SIZES)
def test_silu_and_mul_matches_reference(intermediate, num_tokens, dtype):
    # 2048 columns take two programs per row (1024 columns each); 576 and 896 are masked.
    gate_up = randn(num_tokens, 2 * intermediate, dtype=dtype, seed=intermediate, scale=4.0)
    got = triton_fused.silu_and_mul(gate_up)
    assert got.shape == (num_tokens, intermediate)
    assert_matches(got, reference.silu_and_mul(gate_up))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, as intended
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_at_the_ends_of_the_range(dtype):
    # exp(-gate) overflows to inf for gate <= -89 (silu -> -0) and is 0 for large gates
    # (silu -> gate); a product past float16's range is inf in both backends.
    big = torch.finfo(dtype).max
    gate = torch.tensor([[-big, -100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, big]], dtype=dtype)
    up = torch.tensor([[3.0, 3.0, -2.0, 5.0, 7.0, 5.0, -2.0, 3.0, 2.0]], dtype=dtype)
    gate_up = torch.cat([gate, up], dim=1)
    got, want = triton_fused.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)
    assert torch.equal(got.isinf(), want.isinf())
    assert got[0, -1] == float("inf")
    finite = want.isfinite()
    assert_matches(got[finite], want[finite])
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 where the reference has it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [896, 2048])
def test_gelu_tanh_and_mul_matches_reference(intermediate, dtype):
    # Gates of N(0, 16), many in the negative tail, where torch's 1 + tanh(inner) keeps only
    # tanh's last bits: the kernel's tanh rounds as torch's does. Past inner = -8.664 (gate <
    # -5.06) torch's vectorised CPU tanh is -1 (Sleef's cutoff), so its gelu is -0.0; CUDA's tanhf
    # and the kernel keep the last ulp of 1 + tanh up to inner = -9.01: they differ from it there
    # by one ulp of 1 (2^-24) times 0.5 * gate * up, plus the rounding to the dtype.
    gate_up = randn(3, 2 * intermediate, dtype=dtype, seed=intermediate + 1, scale=4.0)
    got, want = triton_fused.gelu_tanh_and_mul(gate_up), reference.gelu_tanh_and_mul(gate_up)
    assert got.shape == (3, intermediate)
    gate, up = gate_up.float().split(intermediate, dim=1)
    tail = gate < -5.0
    assert 0 < int(tail.sum()) < tail.numel() // 4
    assert_matches(got[~tail], want[~tail])
    err = (got.float() - want.float()).abs()
    assert bool((err <= 1e-7 * (gate * up).abs())[tail].all())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, as intended
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_at_the_ends_of_the_range(dtype):
    # gate^3 overflows to -inf / inf (tanh -> -1 / 1: gelu -> -0 / gate); tanh(inner) is -1 in
    # both backends well below gate = -5.2; a product past float16's range is inf in both.
    big = torch.finfo(dtype).max
    gate = [-big, -100.0, -10.0, -4.0, -1e-3, 0.0, 1e-3, 4.0, 100.0, big]
    gate = torch.tensor([gate], dtype=dtype)
    up = torch.tensor([[3.0, 3.0, -2.0, 5.0, 7.0, 5.0, -2.0, 3.0, 3.0, 2.0]], dtype=dtype)
    gate_up = torch.cat([gate, up], dim=1)
    got, want = triton_fused.gelu_tanh_and_mul(gate_up), reference.gelu_tanh_and_mul(gate_up)
    assert torch.equal(got.isinf(), want.isinf())
    assert got[0, -1] == float("inf")
    finite = want.isfinite()
    assert_matches(got[finite], want[finite])
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 where the reference has it


def test_silu_and_mul_of_strided_rows():
    wide = randn(3, 200, dtype=torch.float32, seed=5)
    gate_up = wide[:, :192]
    assert_matches(triton_fused.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))


# -------------------------------------------------------------------------- rotary + KV cache

# (num_heads, num_kv_heads, head_dim): MHA, GQA 3 (SmolLM2 9/3), 4 (Llama-3.2-1B 32/8), 7
# (Qwen2-0.5B 14/2), head_dim 128, and 96 (48 pairs: masked halves).
ROTARY_HEADS = [(4, 4, 64), (9, 3, 64), (32, 8, 64), (14, 2, 64), (8, 2, 128), (6, 2, 96)]


def rotary_tables(head_dim: int) -> RotaryEmbedding:
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    return RotaryEmbedding(head_dim, MAX_POSITIONS, 500000.0, scaling)


def rotary_inputs(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """qkv, positions (the table's first and last among them) and slot_mapping (every third
    token padding, the others in random slots of a cache with room to spare)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen)
    positions[0] = MAX_POSITIONS - 1
    if num_tokens > 1:
        positions[-1] = 0
    num_blocks = num_tokens // block_size + 3
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[1::3] = -1
    return qkv, positions, slot_mapping, num_blocks


def sentinel_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, copies):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.full(shape, SENTINEL, dtype=dtype) for _ in range(copies)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), ROTARY_HEADS)
def test_rotary_and_cache_matches_reference(
    num_heads, num_kv_heads, head_dim, num_tokens, block_size, dtype
):
    rotary = rotary_tables(head_dim)
    qkv, positions, slot_mapping, num_blocks = rotary_inputs(
        num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=num_heads + head_dim
    )
    k_cache, v_cache, ref_k, ref_v = sentinel_caches(
        num_blocks, block_size, num_kv_heads, head_dim, dtype, copies=4
    )
    tables = (rotary.cos, rotary.sin)
    heads = (num_heads, num_kv_heads, head_dim)
    qkv_before = qkv.clone()

    q = triton_fused.rotary_and_cache(
        qkv, positions, *tables, k_cache, v_cache, slot_mapping, *heads
    )
    want = reference.rotary_and_cache(qkv, positions, *tables, ref_k, ref_v, slot_mapping, *heads)

    assert q.shape == (num_tokens, num_heads, head_dim) and q.is_contiguous()
    assert_matches(q, want)
    assert_matches(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)  # v is copied, not computed
    assert torch.equal(qkv, qkv_before)
    # Exactly the real tokens' slots were written; padding wrote nothing.
    real = slot_mapping[slot_mapping >= 0]
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    untouched = torch.ones(k_slots.shape[0], dtype=torch.bool)
    untouched[real] = False
    assert bool((k_slots[untouched] == SENTINEL).all() and (v_slots[untouched] == SENTINEL).all())
    v_size = num_kv_heads * head_dim
    assert torch.equal(v_slots[real], qkv[slot_mapping >= 0, -v_size:].view(-1, *heads[1:]))


def test_rotary_position_zero_is_the_identity_and_padding_only_writes_nothing():
    rotary = rotary_tables(64)
    qkv = randn(2, (4 + 2 * 2) * 64, dtype=torch.float16, seed=7)
    k_cache, v_cache = sentinel_caches(2, 8, 2, 64, torch.float16, copies=2)
    positions = torch.zeros(2, dtype=torch.int64)
    slots = torch.tensor([-1, -3])
    q = triton_fused.rotary_and_cache(
        qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache, slots, 4, 2, 64
    )
    assert torch.equal(q, qkv[:, : 4 * 64].view(2, 4, 64))  # cos 0 = 1, sin 0 = 0
    assert bool((k_cache == SENTINEL).all() and (v_cache == SENTINEL).all())


def test_rotary_and_cache_without_host_checks():
    # The reference raises for a slot past the cache and a position past the table; the kernel
    # cannot look without a host sync, so it skips the slot and clamps the position.
    rotary = rotary_tables(64)
    qkv = randn(2, (2 + 2 * 1) * 64, dtype=torch.float32, seed=9)
    k_cache, v_cache = sentinel_caches(2, 4, 1, 64, torch.float32, copies=2)
    args = (rotary.cos, rotary.sin, k_cache, v_cache)
    with pytest.raises(ValueError, match="slot_mapping holds slot 8, but the cache has only 8"):
        reference.rotary_and_cache(qkv, torch.tensor([3, 4]), *args, torch.tensor([8, 0]), 2, 1, 64)
    with pytest.raises(IndexError):
        reference.rotary_and_cache(
            qkv, torch.tensor([MAX_POSITIONS, 0]), *args, torch.tensor([1, 0]), 2, 1, 64
        )
    k_cache.fill_(SENTINEL)
    v_cache.fill_(SENTINEL)
    positions = torch.tensor([MAX_POSITIONS + 5, MAX_POSITIONS - 1])
    q = triton_fused.rotary_and_cache(qkv, positions, *args, torch.tensor([8, 5]), 2, 1, 64)
    last = torch.tensor([MAX_POSITIONS - 1] * 2)
    want = reference.rotary_and_cache(
        qkv, last, rotary.cos, rotary.sin, *sentinel_caches(2, 4, 1, 64, torch.float32, 2),
        torch.tensor([-1, -1]), 2, 1, 64,
    )  # fmt: skip
    assert_matches(q, want)  # both tokens rotated by the table's last row
    written = (k_cache != SENTINEL).view(8, -1).any(-1)
    assert written.tolist() == [False] * 5 + [True] + [False] * 2


# ------------------------------------------------------------------- reference == model's math


def model_weight(hidden: int, dtype: torch.dtype, seed: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(randn(hidden, dtype=dtype, seed=seed), requires_grad=False)


# The references against the math the model ran before it called them (transformers' own modules
# where they exist), so that the switch to ops left the engine's tokens unchanged.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_norms_equal_transformers_exactly(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(896, eps=EPS).to(dtype)
    hf.weight.data = model_weight(896, dtype, seed=1)
    x = randn(17, 896, dtype=dtype, seed=2, scale=3.0)
    residual = randn(17, 896, dtype=dtype, seed=3)
    with torch.no_grad():
        assert torch.equal(reference.rms_norm(x, hf.weight, EPS), hf(x))
        # transformers' decoder layer: x = residual + sublayer(...), then the next norm of x.
        hf_sum = residual + x
        out, new_residual = reference.fused_add_rms_norm(x, residual, hf.weight, EPS)
        assert torch.equal(new_residual, hf_sum)
        assert torch.equal(out, hf(hf_sum))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_silu_and_mul_equals_the_swiglu_activation_exactly(dtype):
    size = 96
    gate_up = randn(5, 2 * size, dtype=dtype, seed=5)
    gate, up = gate_up[:, :size], gate_up[:, size:]
    assert torch.equal(reference.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_rotary_and_cache_equals_apply_rotary_and_reshape_and_cache(dtype):
    # What engine/models/model.py did before the fused op: rotate q and k heads together with
    # engine/models/rotary.py, then reshape_and_cache.
    from pagedserve.engine.models.rotary import apply_rotary

    num_heads, num_kv_heads, head_dim, block_size, n = 6, 2, 64, 8, 7
    qkv = randn(n, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=6)
    rotary = rotary_tables(head_dim)
    positions = torch.tensor([0, 1, 2, 700, 701, 4094, MAX_POSITIONS - 1])
    slot_mapping = torch.tensor([0, 1, -1, 9, 10, 30, 31])
    model_k, model_v, ref_k, ref_v = sentinel_caches(
        4, block_size, num_kv_heads, head_dim, dtype, 4
    )
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qk = qkv[:, : q_size + kv_size].view(n, num_heads + num_kv_heads, head_dim)
    qk = apply_rotary(qk, *rotary.cos_sin(positions, dtype))
    model_q, k = qk.split([num_heads, num_kv_heads], dim=1)
    v = qkv[:, q_size + kv_size :].view(n, num_kv_heads, head_dim)
    reference.reshape_and_cache(k, v, model_k, model_v, slot_mapping)

    q = reference.rotary_and_cache(
        qkv, positions, rotary.cos, rotary.sin, ref_k, ref_v, slot_mapping,
        num_heads, num_kv_heads, head_dim,
    )  # fmt: skip
    assert torch.equal(q, model_q)
    assert torch.equal(ref_k, model_k) and torch.equal(ref_v, model_v)
    written = (ref_k != SENTINEL).view(-1, num_kv_heads * head_dim).any(-1)
    assert written.nonzero().flatten().tolist() == [0, 1, 9, 10, 30, 31]


# ------------------------------------------------------------------------- arguments, empties


@pytest.mark.parametrize("ops", BACKENDS, ids=lambda m: m.__name__)
def test_empty_batches(ops):
    x, weight = torch.zeros(0, 64), torch.ones(64)
    assert ops.rms_norm(x, weight, EPS).shape == (0, 64)
    out, residual = ops.fused_add_rms_norm(x, x.clone(), weight, EPS)
    assert out.shape == residual.shape == (0, 64)
    assert ops.silu_and_mul(torch.zeros(0, 128)).shape == (0, 64)
    assert ops.gelu_tanh_and_mul(torch.zeros(0, 128)).shape == (0, 64)
    rotary = rotary_tables(64)
    k_cache, v_cache = sentinel_caches(2, 8, 2, 64, torch.float32, copies=2)
    q = ops.rotary_and_cache(
        torch.zeros(0, 8 * 64), torch.zeros(0, dtype=torch.int64), rotary.cos, rotary.sin,
        k_cache, v_cache, torch.zeros(0, dtype=torch.int64), 4, 2, 64,
    )  # fmt: skip
    assert q.shape == (0, 4, 64)
    assert bool((k_cache == SENTINEL).all())


def _rotary_call(ops, **change):
    """rotary_and_cache on valid small arguments, with `change` swapped in."""
    rotary = rotary_tables(64)
    args = dict(
        qkv=torch.zeros(3, 8 * 64), positions=torch.zeros(3, dtype=torch.int64),
        cos_table=rotary.cos, sin_table=rotary.sin, k_cache=torch.zeros(2, 8, 2, 64),
        v_cache=torch.zeros(2, 8, 2, 64), slot_mapping=torch.zeros(3, dtype=torch.int64),
        num_heads=4, num_kv_heads=2, head_dim=64,
    )  # fmt: skip
    return ops.rotary_and_cache(**(args | change))


@pytest.mark.parametrize("ops", BACKENDS, ids=lambda m: m.__name__)
def test_bad_arguments_raise_the_same_errors_in_both_backends(ops):
    x, weight = torch.zeros(3, 64), torch.ones(64)
    bad_norm = [
        ((torch.zeros(64), weight), r"x must be \[num_tokens, hidden_size\], got shape \(64,\)"),
        ((x, torch.ones(32)), r"weight must be \[64\] like x's last dim, got \(32,\)"),
        ((x, weight.half()), "weight dtype torch.float16 differs from x dtype torch.float32"),
        ((x.long(), weight.long()), "x must be a floating-point tensor, got torch.int64"),
        ((torch.zeros(64, 3).t(), weight), "x must be contiguous along its last dim"),
        ((x, weight.to("meta")), "all tensors must be on one device, got x on cpu, weight on"),
    ]
    for args, message in bad_norm:
        with pytest.raises(ValueError, match=message):
            ops.rms_norm(*args, EPS)
    with pytest.raises(ValueError, match="eps must be a non-negative Python float, got -1.0"):
        ops.rms_norm(x, weight, -1.0)
    with pytest.raises(ValueError, match=r"residual must be \(3, 64\) torch.float32 like x"):
        ops.fused_add_rms_norm(x, torch.zeros(3, 64).half(), weight, EPS)
    for act_and_mul in (ops.silu_and_mul, ops.gelu_tanh_and_mul):
        with pytest.raises(ValueError, match=r"gate_up must hold gate and up side by side"):
            act_and_mul(torch.zeros(3, 63))

    bad_rotary = [
        (dict(head_dim=63), "head_dim must be even"),
        (dict(num_kv_heads=0), "num_kv_heads must be a positive int, got 0"),
        (dict(qkv=torch.zeros(3, 7 * 64)), "qkv has 448 columns, but 4 q heads .* need 512"),
        (dict(positions=torch.zeros(3, dtype=torch.int32)), "positions must be torch.int64"),
        (dict(slot_mapping=torch.zeros(2, dtype=torch.int64)), "slot_mapping has 2 entries"),
        (dict(cos_table=torch.zeros(16, 64).double()), "cos_table must be torch.float32"),
        (dict(sin_table=torch.zeros(16, 32)), r"sin_table must be \[max_positions, head_dim"),
        (dict(k_cache=torch.zeros(2, 8, 4, 32), v_cache=torch.zeros(2, 8, 4, 32)),
         "k_cache holds 4 kv heads of dim 32, expected 2 of dim 64"),
        (dict(v_cache=torch.zeros(2, 8, 2, 64).half()), "v_cache dtype torch.float16 differs"),
        (dict(k_cache=torch.zeros(2, 8, 2, 64).half(), v_cache=torch.zeros(2, 8, 2, 64).half()),
         "qkv dtype torch.float32 differs from the cache dtype torch.float16"),
        (dict(k_cache=torch.zeros(2, 8, 2, 128)[..., ::2]),
         "k_cache must be contiguous along head_dim"),
    ]  # fmt: skip
    for change, message in bad_rotary:
        with pytest.raises(ValueError, match=message):
            _rotary_call(ops, **change)
