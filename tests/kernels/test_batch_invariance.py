"""One request, one answer, op by op: each CPU op's result for a row is a function of that row's
inputs (and, for attention, its position and keys) alone, bit for bit, whatever else shares the
step: a row computed in a step of 1, 7, 16, 17, 64 or 300 rows, a query attended in a decode, in
a prefill chunk of any length, alone or among other sequences, gives the same bits. These are
the defaults (`cpu_features.batch_variant` off); the engine-level cases are
tests/server/test_one_answer.py's.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from pagedserve.engine.models import cpu_linear
from pagedserve.engine.models import quantized_linear as ql
from pagedserve.engine.models.quantized_linear import BlockWeight, gguf_rows
from pagedserve.kernels import cpu_features, cpu_ops
from tests import kquants

STEPS = (1, 7, 16, 17, 64, 300)
Q = gguf.GGMLQuantizationType

needs_kernels = pytest.mark.skipif(
    not cpu_ops.available(), reason="pagedserve's CPU kernels did not load (no C++ compiler)"
)
needs_block_dot = pytest.mark.skipif(
    not ql.block_dot_isa(), reason="no block dot products here (no AVX2 or no compiled kernels)"
)


def _rows(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    # Each row its own scale, as a step's hidden states are (a row's blocks are quantized alone).
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-2, 2, n).unsqueeze(1)
    return (torch.randn(n, k, generator=gen) * scales).to(dtype)


def _same_rows_in_every_step(fn, x: torch.Tensor) -> None:
    """fn(x[:m]) for each m in STEPS: every row bitwise as in the longest step."""
    whole = fn(x)
    for m in STEPS[:-1]:
        part = fn(x[:m].clone())
        assert torch.equal(part, whole[:m]), f"a step of {m} rows differs from one of {len(x)}"


def test_the_default_is_invariant_and_the_faster_paths_opt_in(monkeypatch):
    monkeypatch.delenv(cpu_features.BATCH_VARIANT_ENV, raising=False)
    cpu_features.batch_variant.cache_clear()
    try:
        assert not cpu_features.batch_variant()
        if ql.block_dot_isa():  # every step of kept weights multiplies by the blocks
            assert {ql.route(m, dt) for m in STEPS for dt in ql.ACTIVATION_DTYPES} == {"blocks"}
        assert all(cpu_ops.kernel_attends(m, m, torch.bfloat16, 64) for m in STEPS)
        monkeypatch.setenv(cpu_features.BATCH_VARIANT_ENV, "1")
        cpu_features.batch_variant.cache_clear()
        assert cpu_features.batch_variant()
        assert not cpu_ops.kernel_attends(300, 300, torch.float16, 80)
        monkeypatch.setenv(cpu_features.BATCH_VARIANT_ENV, "sometimes")
        cpu_features.batch_variant.cache_clear()
        with pytest.raises(ValueError, match="PAGEDSERVE_BATCH_VARIANT must be 1 or 0"):
            cpu_features.batch_variant()
    finally:
        monkeypatch.undo()
        cpu_features.batch_variant.cache_clear()


@needs_block_dot
@pytest.mark.parametrize("qtype", ql.KEPT_TYPES)
@pytest.mark.parametrize("dtype", ql.ACTIVATION_DTYPES)
def test_a_kept_weights_rows_are_the_same_in_a_step_of_any_rows(qtype, dtype):
    """Every block type, file layout and interleaved rows, tiles of 1 to 4 rows and their
    remainders, float32 logits out of bfloat16 rows (the lm_head's) too; and 15-bit activation
    codes: within float32's rounding of the float64 product of the dequantized weight, far closer
    than int8 codes would be."""
    k = 512 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 128
    weight = BlockWeight(gguf_rows(kquants.random_blocks(qtype, 72, k, seed=9), qtype, (72, k)))
    x = _rows(STEPS[-1], k, dtype, seed=int(qtype))
    _same_rows_in_every_step(weight.linear, x)
    _same_rows_in_every_step(lambda rows: weight.linear(rows, float_out=True), x)
    exact = x.double() @ weight.dequantize().double().T
    got = weight.linear(x, float_out=True).double()
    error = ((got - exact).abs().amax(1) / exact.abs().amax(1)).max().item()
    assert error < 2e-4, error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 1536), (576, 1536), (1536, 576), (49152, 576)])
def test_a_dense_weights_rows_are_the_same_in_a_step_of_any_rows(dtype, shape):
    """Dense weights (`--quantization none`, LoRA's matrices) through `cpu_linear.linear`: packed
    for oneDNN where the CPU allows, whose kernel for one row sums in another order than its
    kernel for more (float32 at K = 1536 on every row here, bfloat16 on some): a lone row goes
    through as two. Every row of the step of 300 alone, and the steps of STEPS."""
    weight = torch.nn.Parameter(_rows(shape[0], shape[1], dtype, seed=7), requires_grad=False)
    cpu_linear.pack(weight)
    x = _rows(STEPS[-1], shape[1], dtype, seed=8)
    _same_rows_in_every_step(lambda rows: cpu_linear.linear(rows, weight), x)
    whole = cpu_linear.linear(x, weight)
    alone = torch.cat([cpu_linear.linear(x[i : i + 1].clone(), weight) for i in range(len(x))])
    assert torch.equal(alone, whole)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_ops_rows_are_the_same_in_a_step_of_any_rows(dtype):
    hidden, heads, kv_heads, head_dim = 192, 3, 1, 64
    x = _rows(STEPS[-1], hidden, dtype, seed=1)
    residual = _rows(STEPS[-1], hidden, dtype, seed=2)
    weight = torch.rand(hidden).to(dtype) + 0.5
    _same_rows_in_every_step(lambda rows: cpu_ops.rms_norm(rows, weight, 1e-5), x)
    _same_rows_in_every_step(
        lambda rows: torch.cat(
            cpu_ops.fused_add_rms_norm(rows, residual[: len(rows)].clone(), weight, 1e-5), 1
        ),
        x,
    )
    _same_rows_in_every_step(cpu_ops.silu_and_mul, x)
    # Rotary + the cache write: q and the written keys and values of each row.
    qkv = _rows(STEPS[-1], (heads + 2 * kv_heads) * head_dim, dtype, seed=3)
    positions = torch.arange(STEPS[-1]) * 7 % 1000
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(1000).float(), inv).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()

    def rotary(rows: torch.Tensor) -> torch.Tensor:
        n = len(rows)
        k_cache = torch.zeros(n, 1, kv_heads, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        q = cpu_ops.rotary_and_cache(
            rows, positions[:n], cos, sin, k_cache, v_cache, torch.arange(n), heads, kv_heads,
            head_dim,
        )  # fmt: skip
        return torch.cat([q.flatten(1), k_cache.flatten(1), v_cache.flatten(1)], 1)

    _same_rows_in_every_step(rotary, qkv)


class _Sequences:
    """Sequences of fixed random queries, keys and values (sequence i from seed i, `lengths[i]`
    tokens), every key and value written into one paged cache (sequence i in its own run of
    blocks), so that any step over any of them can be attended: `step([(i, cached, new), ...])`
    attends sequence i's tokens cached..cached+new-1 over its keys 0..cached+new-1."""

    def __init__(self, lengths, heads, kv_heads, head_dim, dtype, block_size=16) -> None:
        self.block_size, self.heads, self.head_dim = block_size, heads, head_dim
        self.q, self.tables = [], []
        blocks = [-(-n // block_size) for n in lengths]
        shape = (sum(blocks), block_size, kv_heads, head_dim)
        self.k_cache, self.v_cache = (
            torch.zeros(shape, dtype=dtype),
            torch.zeros(shape, dtype=dtype),
        )
        first = 0
        for i, n in enumerate(lengths):
            gen = torch.Generator().manual_seed(i)
            self.q.append(torch.randn(n, heads, head_dim, generator=gen).to(dtype))
            for cache in (self.k_cache, self.v_cache):
                values = torch.randn(blocks[i] * block_size, kv_heads, head_dim, generator=gen)
                cache[first : first + blocks[i]] = values.view(-1, block_size, kv_heads, head_dim)
            self.tables.append(list(range(first, first + blocks[i])))
            first += blocks[i]

    def step(self, parts: list[tuple[int, int, int]], **options) -> list[torch.Tensor]:
        width = max(len(t) for t in self.tables)
        tables = torch.tensor([self.tables[i] + [0] * (width - len(self.tables[i]))
                               for i, _, _ in parts], dtype=torch.int32)  # fmt: skip
        q = torch.cat([self.q[i][c : c + n] for i, c, n in parts])
        lens = torch.tensor([c + n for _, c, n in parts], dtype=torch.int32)
        starts = torch.tensor([0] + [n for _, _, n in parts], dtype=torch.int32).cumsum(0)
        out = cpu_ops.paged_attention(
            q, self.k_cache, self.v_cache, tables, lens, starts.to(torch.int32), 0.125, **options
        )
        return [out[a:b] for a, b in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 40, "softcap": 5.0}])
@pytest.mark.parametrize("heads, head_dim", [((9, 3), 64), ((4, 1), 256), ((8, 2), 128)])
def test_a_query_attends_the_same_in_a_decode_a_chunk_of_any_length_and_any_batch(
    dtype, options, heads, head_dim
):
    """A 300-token prompt's queries: whole in one step, as chunks of 1, 16 and 17 tokens over
    its cached head (the prefix cache's and --max-num-batched-tokens' steps, decodes), and beside
    other sequences (a long prefill, decodes of 1k keys, short extends): the same bits each way."""
    n = 300
    seqs = _Sequences([n, 200, 1000, 42], heads[0], heads[1], head_dim, dtype)
    (whole,) = seqs.step([(0, 0, n)], **options)
    for cached in (0, 1, 16, 130, 283, 299):
        for length in sorted({1, 16, 17, n - cached} & set(range(1, n - cached + 1))):
            (got,) = seqs.step([(0, cached, length)], **options)
            assert torch.equal(got, whole[cached : cached + length]), (cached, length)
    mixed = [(1, 0, 200), (0, 0, n), (2, 999, 1), (3, 37, 5)]
    assert torch.equal(seqs.step(mixed, **options)[1], whole)
    decodes = [(2, 999, 1)] * 7 + [(0, 283, 17)] + [(3, 41, 1)] * 8
    assert torch.equal(seqs.step(decodes, **options)[7], whole[283:])


@needs_kernels
def test_one_streams_decode_is_not_split_across_threads_by_default():
    """On 2 and 3 threads (where --batch-variant splits one stream's keys): a decode alone and
    among 15 others give the same bits."""
    seqs = _Sequences([1000, 500], 9, 3, 64, torch.float32)
    previous = torch.get_num_threads()
    try:
        for threads in (2, 3):
            torch.set_num_threads(threads)
            (alone,) = seqs.step([(0, 999, 1)])
            among = seqs.step([(0, 999, 1), *[(1, 499, 1)] * 15])
            assert torch.equal(alone, among[0])
    finally:
        torch.set_num_threads(previous)
