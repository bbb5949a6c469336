"""Parity of the Triton paged attention and KV-cache write with the reference and with dense
float64 attention.

Without a GPU (CI) these run the real Triton kernels under Triton's interpreter
(TRITON_INTERPRET=1, set in tests/conftest.py), which executes every program of the grid with
numpy: same kernel code, same index arithmetic, same masks; only the compiler and the hardware are
left out. The coverage list's dtypes: float32 throughout, float16 once; bfloat16 only on the
GPU (`python -m benchmarks.gpu_kernels`), as the interpreter cannot compute a bf16 tl.dot.

Tolerance: float32 against float64 dense attention, atol = rtol = 1e-5, as for the reference (the
observed error is about 2e-6: softmax rounding summed over a few hundred keys).
"""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve import kernels
from pagedserve.kernels import reference, triton_attention, triton_ops
from tests.helpers import record_calls
from tests.kernels.paged_batch import (
    MIXED,
    Batch,
    check_close_to_float64,
    check_empty_step_and_int64_seq_lens,
    dense_attention,
    make_batch,
)

pytestmark = pytest.mark.skipif(
    not triton_attention.INTERPRETED,
    reason="CPU tensors need Triton's interpreter, which tests/conftest.py turns on only on "
    "machines without a GPU; on a GPU, `python -m benchmarks.gpu_kernels` checks the "
    "compiled kernels",
)

TOL = dict(atol=1e-5, rtol=1e-5)

# (num_heads, num_kv_heads): GQA ratios 1, 2, 3 (SmolLM2's 9 over 3), 4 and 8, and head counts
# that are not powers of two.
HEADS = [(4, 4), (6, 3), (9, 3), (8, 2), (16, 2)]


def args(batch: Batch) -> tuple:
    return batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens
    # query_start_loc is passed by the callers, after these


def triton_run(batch: Batch, scale: float, **kwargs) -> torch.Tensor:
    return triton_attention.paged_attention(*args(batch), batch.query_start_loc, scale, **kwargs)


def decode_run(
    batch: Batch, scale: float, num_splits: int, sliding_window=None, softcap=None
) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    triton_attention.decode(
        *args(batch), batch.query_start_loc, scale, sliding_window, out, num_splits,
        softcap=softcap,
    )  # fmt: skip
    return out


def extend_run(batch: Batch, scale: float, sliding_window=None, softcap=None) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    triton_attention.extend(
        *args(batch), batch.query_start_loc, scale, sliding_window, out, softcap=softcap
    )
    return out


def check(got: torch.Tensor, batch: Batch, scale: float, sliding_window=None, softcap=None) -> None:
    want = dense_attention(batch, scale, sliding_window, softcap).float()
    torch.testing.assert_close(got, want, **TOL)
    ref = reference.paged_attention(
        *args(batch), batch.query_start_loc, scale, sliding_window=sliding_window, softcap=softcap
    )
    torch.testing.assert_close(got, ref, **TOL)


# ------------------------------------------------------------------------- prefill / extend


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_mixed_batch_matches_reference(num_heads, num_kv_heads, block_size, head_dim):
    # MIXED interleaves fresh prefills, extends over cached prefixes and decodes, so the one
    # extend launch covers sequences of every kind, 1-token contexts included.
    batch = make_batch(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=num_heads * block_size + head_dim,
    )
    scale = 1 / math.sqrt(head_dim)
    check(triton_run(batch, scale), batch, scale)


def test_prompt_spanning_many_query_tiles_and_key_tiles():
    # GQA 1: 128 tokens per query tile. 300 new tokens = 3 tiles; 700 + 300 keys = 16 key tiles
    # of 64, the first ones read without a mask.
    batch = make_batch([(700, 300), (0, 130)], num_heads=2, num_kv_heads=2, head_dim=64,
                       block_size=16, seed=4)  # fmt: skip
    check(triton_run(batch, 0.125), batch, 0.125)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 1)])
def test_diagonal_at_every_offset_within_a_key_tile(num_heads, num_kv_heads):
    # A tile's first row sits at position num_cached (+ a multiple of BLOCK_Q = 128 // group);
    # keys up to it are read without a mask. Cached lengths 58..69 put it at every offset around
    # the 64-key tile edge, where an off-by-one would let a row see its successors.
    seqs = [(c, 3 + c % 5) for c in range(58, 70)] + [(110, 20)]
    batch = make_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                       block_size=16, seed=num_heads)  # fmt: skip
    check(triton_run(batch, 0.125), batch, 0.125)


def test_extend_over_a_4k_prefix():
    batch = make_batch([(4000, 40), (33, 7)], num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=32, seed=6)  # fmt: skip
    check(triton_run(batch, 0.125), batch, 0.125)


@pytest.mark.parametrize("sliding_window", [1, 4, 11, 70, 5000])
def test_sliding_window_extend(sliding_window):
    # Windows shorter than a block, across blocks and tiles, and longer than any context.
    seqs = [*MIXED, (150, 40)]
    batch = make_batch(seqs, num_heads=6, num_kv_heads=2, head_dim=64, block_size=8, seed=3)
    got = triton_run(batch, 0.125, sliding_window=sliding_window)
    check(got, batch, 0.125, sliding_window)
    if sliding_window < 150:  # else the window changes nothing
        assert not torch.allclose(got, dense_attention(batch, 0.125).float(), atol=1e-3)


# ------------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_decode_matches_reference(num_heads, num_kv_heads, block_size, head_dim):
    # Contexts of 1 token, at and across block edges, and longer than one 128-key tile.
    seqs = [(0, 1), (block_size - 1, 1), (block_size, 1), (2 * block_size + 3, 1), (290, 1)]
    batch = make_batch(
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=num_heads + block_size + head_dim,
    )
    scale = 1 / math.sqrt(head_dim)
    check(triton_run(batch, scale), batch, scale)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_context_is_merged_exactly(num_splits):
    # With 8 splits the 1- and 17-token contexts leave most slices empty (zero weight).
    seqs = [(0, 1), (16, 1), (200, 1), (777, 1)]
    batch = make_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=8)
    check(decode_run(batch, 0.125, num_splits), batch, 0.125)


@pytest.mark.parametrize(("sliding_window", "num_splits"), [(1, 1), (7, 2), (100, 4), (900, 3)])
def test_sliding_window_decode(sliding_window, num_splits):
    seqs = [(0, 1), (5, 1), (130, 1), (600, 1)]
    batch = make_batch(seqs, num_heads=8, num_kv_heads=4, head_dim=64, block_size=16, seed=12)
    check(decode_run(batch, 0.125, num_splits, sliding_window), batch, 0.125, sliding_window)


def test_decode_of_a_32k_context(batch_variant):
    # One long sequence: with PAGEDSERVE_BATCH_VARIANT=1 the public entry point splits it (4 "SMs"
    # on CPU, see num_decode_splits); by default it never splits (test_triton_batch_invariance.py).
    batch = make_batch([(32767, 1)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=32,
                       seed=10)  # fmt: skip
    max_context = batch.block_tables.shape[1] * 32
    assert triton_attention.num_decode_splits(1, 1, max_context, batch.q.device) == 8
    check(triton_run(batch, 0.125), batch, 0.125)


def test_decode_kernel_handles_any_layout():
    # num_tokens == num_seqs also fits 2 new tokens + 0 new tokens: the decode kernel is chosen
    # from shapes alone, and finds each token's sequence and position on its own.
    batch = make_batch([(4, 2), (6, 0)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=4)
    assert batch.q.shape[0] == batch.block_tables.shape[0] == 2
    check(triton_run(batch, 0.125), batch, 0.125)
    check(decode_run(batch, 0.125, 3), batch, 0.125)


def test_decode_kernel_is_correct_for_a_mixed_batch_too():
    # More tokens than sequences: the fast "token i is sequence i" test must not read past the
    # end of query_start_loc, and every token finds its sequence by the binary search.
    batch = make_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=64, block_size=8, seed=5)
    check(decode_run(batch, 0.125, 2), batch, 0.125)


def test_extend_kernel_runs_decode_steps_too():
    seqs = [(0, 1), (15, 1), (40, 1)]
    batch = make_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=2)
    check(extend_run(batch, 0.125), batch, 0.125)


def test_num_decode_splits_fills_the_machine_from_shapes():
    cpu = torch.device("cpu")  # 4 SMs assumed: 8 programs wanted
    assert triton_attention.num_decode_splits(1, 1, 8192, cpu) == 8
    assert triton_attention.num_decode_splits(1, 3, 8192, cpu) == 2  # ceil(8 / 3) = 3 -> 2
    assert triton_attention.num_decode_splits(8, 1, 8192, cpu) == 1
    assert triton_attention.num_decode_splits(1, 1, 700, cpu) == 2  # 256+ keys per slice
    assert triton_attention.num_decode_splits(1, 1, 255, cpu) == 1


@pytest.mark.parametrize("seqs", [MIXED, [(0, 1), (40, 1), (300, 1)]], ids=["extend", "decode"])
def test_float16_close_to_float64(seqs):
    # The interpreter runs fp16 tl.dot for real (not bf16: it would multiply raw bit patterns,
    # triton-lang/triton#11584, so bf16 is checked on the GPU by benchmarks.gpu_kernels). fp16
    # keeps 11 significant bits; 5e-3 bounds the rounding of q, K, V, P and the output.
    check_close_to_float64(triton_run, seqs, torch.float16, 5e-3)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 150), st.integers(0, 6)), min_size=1, max_size=4).filter(
        lambda seqs: all(c + n > 0 for c, n in seqs) and any(n > 0 for _, n in seqs)
    ),
    heads=st.sampled_from(HEADS),
    block_size=st.sampled_from([8, 16, 32]),
    sliding_window=st.one_of(st.none(), st.integers(1, 100)),
    num_splits=st.integers(1, 5),
)
def test_random_batches_match_dense(seqs, heads, block_size, sliding_window, num_splits):
    # Any mix of cached and new lengths (new = 0 included), through the public entry (which picks
    # the kernel from the shapes) and through the decode kernel with a random number of splits.
    # Few new tokens per sequence: the interpreter runs the decode kernel once per token.
    batch = make_batch(
        seqs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64, block_size=block_size,
        seed=len(seqs),
    )  # fmt: skip
    want = dense_attention(batch, 0.125, sliding_window).float()
    torch.testing.assert_close(triton_run(batch, 0.125, sliding_window=sliding_window), want, **TOL)
    got = decode_run(batch, 0.125, num_splits, sliding_window)
    torch.testing.assert_close(got, want, **TOL)


# ---------------------------------------------------------------------------- soft-capping

# Scale 0.3 gives scores of a few units: a cap of 2 bends them through every branch of the
# kernels' tanh (|s / cap| below 0.25, up to 0.55 and beyond).
SOFTCAP_SCALE, SOFTCAP = 0.3, 2.0


@pytest.mark.parametrize(("sliding_window", "num_splits"), [(None, 1), (None, 3), (7, 2)])
def test_softcap_decode(sliding_window, num_splits):
    seqs = [(0, 1), (5, 1), (130, 1), (300, 1)]
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, seed=14)
    got = decode_run(batch, SOFTCAP_SCALE, num_splits, sliding_window, SOFTCAP)
    check(got, batch, SOFTCAP_SCALE, sliding_window, SOFTCAP)
    uncapped = dense_attention(batch, SOFTCAP_SCALE, sliding_window).float()
    assert not torch.allclose(got, uncapped, atol=1e-2)


@pytest.mark.parametrize("sliding_window", [None, 11])
def test_softcap_extend(sliding_window):
    # MIXED: prefills, extends and decodes in one extend launch, through the public entry.
    batch = make_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=64, block_size=8, seed=15)
    got = triton_run(batch, SOFTCAP_SCALE, sliding_window=sliding_window, softcap=SOFTCAP)
    check(got, batch, SOFTCAP_SCALE, sliding_window, SOFTCAP)


def test_softcap_at_gemma2s_cap_and_the_signature():
    # Gemma 2's cap of 50 over scores of about one: tanh's Taylor branch only, a small change.
    batch = make_batch([(0, 1), (70, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       seed=16)  # fmt: skip
    got = triton_run(batch, 0.125, softcap=50.0)
    check(got, batch, 0.125, softcap=50.0)
    assert not torch.allclose(got, dense_attention(batch, 0.125).float(), **TOL)
    params = inspect.signature(triton_attention.paged_attention).parameters
    assert params == inspect.signature(reference.paged_attention).parameters
    with pytest.raises(ValueError, match="softcap must be None or a positive float, got -1.0"):
        triton_run(batch, 0.125, softcap=-1.0)


# ------------------------------------------------------------------------ robustness, layout


def poison_unused_slots(batch: Batch) -> None:
    """NaN into every cache slot that holds no key of a sequence, the rest of each last block
    included: a kernel that loaded one of them (even masked out afterwards) would output NaN
    through 0 * NaN."""
    block_size = batch.k_cache.shape[1]
    keep = torch.zeros(batch.k_cache.shape[:2], dtype=torch.bool)
    for table, seq_len in zip(batch.block_tables.tolist(), batch.seq_lens.tolist(), strict=True):
        for p in range(seq_len):
            keep[table[p // block_size], p % block_size] = True
    batch.k_cache[~keep] = float("nan")
    batch.v_cache[~keep] = float("nan")


@pytest.mark.parametrize("seqs", [MIXED, [(3, 1), (20, 1), (40, 1)]], ids=["extend", "decode"])
def test_unwritten_slots_are_never_read(seqs):
    batch = make_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=1)
    poison_unused_slots(batch)
    assert batch.k_cache.isnan().any()
    got = triton_run(batch, 0.125)
    torch.testing.assert_close(got, dense_attention(batch, 0.125).float(), **TOL)


def test_out_and_non_contiguous_q():
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=9)
    n = batch.q.shape[0]
    qkv = torch.cat([batch.q.reshape(n, -1), torch.randn(n, 2 * 2 * 64)], dim=1)
    q = qkv[:, : 4 * 64].view(n, 4, 64)
    assert not q.is_contiguous()
    out = torch.full_like(batch.q, float("nan"))
    got = triton_attention.paged_attention(
        q, *args(batch)[1:], batch.query_start_loc, 0.125, out=out
    )
    assert got is out
    check(out, batch, 0.125)


def test_empty_batch_and_bad_arguments():
    batch = check_empty_step_and_int64_seq_lens(triton_attention)
    with pytest.raises(ValueError, match="k_cache must be contiguous along head_dim"):
        strided = torch.zeros(4, 4, 1, 128)[..., ::2]
        triton_attention.paged_attention(
            batch.q, strided, strided, *args(batch)[3:], batch.query_start_loc, 0.125
        )


def test_without_gpu_or_interpreter_the_error_says_what_to_do():
    # A fresh interpreter without TRITON_INTERPRET: the kernels are compiled kernels, which
    # cannot take CPU tensors.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch\n"
        "from pagedserve.kernels import triton_attention as t\n"
        "assert not t.INTERPRETED\n"
        "kv = torch.zeros(1, 1, 16)\n"
        "try:\n"
        "    t.reshape_and_cache(kv, kv, torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16),\n"
        "                        torch.zeros(1, dtype=torch.int64))\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "need CUDA tensors" in done.stdout
    assert "PAGEDSERVE_ATTENTION_BACKEND=torch" in done.stdout
    assert "TRITON_INTERPRET=1" in done.stdout


# --------------------------------------------------------------------------- reshape_and_cache


def test_reshape_and_cache_equals_reference():
    num_blocks, block_size, heads, dim = 6, 8, 3, 64
    slots = [13, -1, 0, 47, 7, -5, 8, 30]
    gen = torch.Generator().manual_seed(0)
    # key/value as the model passes them: views of one qkv row with a token stride > H * D.
    qkv = torch.randn(len(slots), 5 * heads * dim, generator=gen)
    key = qkv[:, : heads * dim].view(-1, heads, dim)
    value = qkv[:, 3 * heads * dim : 4 * heads * dim].view(-1, heads, dim)
    start = torch.randn(num_blocks, block_size, heads, dim, generator=gen)
    want_k, want_v, got_k, got_v = (start.clone() for _ in range(4))
    reference.reshape_and_cache(key, value, want_k, want_v, torch.tensor(slots))
    triton_attention.reshape_and_cache(key, value, got_k, got_v, torch.tensor(slots))
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert torch.equal(got_k[5, 7], key[3])  # slot 47 = block 5, offset 7
    assert not torch.equal(got_k, start)


def test_reshape_and_cache_skips_slots_past_the_cache():
    k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    kv = torch.ones(3, 1, 16)
    triton_attention.reshape_and_cache(kv, kv, k_cache, v_cache, torch.tensor([8, -1, 3]))
    assert k_cache.view(8, 16).sum(-1).tolist() == [0, 0, 0, 16, 0, 0, 0, 0]
    assert torch.equal(v_cache, k_cache)


def test_reshape_and_cache_into_a_combined_cache_view():
    kv_cache = torch.zeros(2, 3, 4, 2, 16)  # [K/V, num_blocks, block_size, Hkv, D]
    key, value = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    triton_attention.reshape_and_cache(key, value, kv_cache[0], kv_cache[1], torch.tensor([5, 11]))
    assert torch.equal(kv_cache[0, 1, 1], key[0]) and torch.equal(kv_cache[0, 2, 3], key[1])
    assert torch.equal(kv_cache[1, 1, 1], value[0]) and torch.equal(kv_cache[1, 2, 3], value[1])
    assert kv_cache.count_nonzero() == key.count_nonzero() + value.count_nonzero()


# --------------------------------------------------------------------------------- copy_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_equals_reference_in_every_cache(dtype):
    # 3 layers x (K, V); blocks of 4 x 2 heads x 16 = 128 elements (two programs of 64 each when
    # the block size in elements is not a power of two: 6 x 2 x 8 = 96).
    gen = torch.Generator().manual_seed(0)
    for shape in ((7, 4, 2, 16), (7, 6, 2, 8)):
        start = [torch.randn(shape, generator=gen).to(dtype) for _ in range(6)]
        src, dst = torch.tensor([0, 5, 3]), torch.tensor([2, 1, 6])
        want, got = [c.clone() for c in start], [c.clone() for c in start]
        reference.copy_blocks(want, src, dst)
        triton_attention.copy_blocks(got, src, dst)
        for before, w, g in zip(start, want, got, strict=True):
            assert torch.equal(g, w)
            assert torch.equal(w[[2, 1, 6]], before[[0, 5, 3]])  # the copies
            assert torch.equal(w[[0, 3, 4, 5]], before[[0, 3, 4, 5]])  # nothing else moved
    empty = [torch.ones(2, 4, 1, 8)]
    triton_attention.copy_blocks(
        empty, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)
    )
    assert torch.equal(empty[0], torch.ones(2, 4, 1, 8))


def test_copy_blocks_refuses_caches_that_differ():
    caches = [torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 4)]
    for op in (reference.copy_blocks, triton_attention.copy_blocks):
        with pytest.raises(ValueError, match=r"caches\[1\] is \(4, 2, 1, 4\)"):
            op(caches, torch.tensor([0]), torch.tensor([1]))
        with pytest.raises(ValueError, match="src .* and dst .* differ in length"):
            op(caches[:1], torch.tensor([0, 1]), torch.tensor([2]))
        with pytest.raises(ValueError, match="must be contiguous"):
            op([torch.zeros(4, 8, 1, 2).transpose(1, 3)], torch.tensor([0]), torch.tensor([1]))


# ---------------------------------------------------------------------------------- dispatch


def test_backend_switch(monkeypatch):
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=11)
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    assert kernels.select_backend(torch.device("cpu")) == "cpu"
    assert kernels.select_backend(torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="cpu runs on CPU tensors only, not on cuda"):
        kernels.resolve_backend("cpu", torch.device("cuda"))
    assert kernels.resolve_backend("torch", torch.device("cuda")) == "torch"
    assert kernels.get_backend("triton") is triton_ops
    with pytest.raises(ValueError, match="attention backend='cuda' is not an attention backend"):
        kernels.resolve_backend("cuda", batch.q.device)

    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    assert kernels.select_backend(batch.q.device) == "triton"
    assert kernels.resolve_backend("torch", batch.q.device) == "torch"  # explicit beats env
    calls = record_calls(monkeypatch, triton_ops, ("paged_attention", "reshape_and_cache"))
    got = kernels.paged_attention(*args(batch), batch.query_start_loc, 0.125)
    check(got, batch, 0.125)
    k = torch.zeros(1, 2, 64)
    kernels.reshape_and_cache(k, k, batch.k_cache, batch.v_cache, torch.tensor([0]))
    assert calls == ["paged_attention", "reshape_and_cache"]
