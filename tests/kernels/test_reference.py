"""Parity of the pure-torch paged attention and KV-cache write with dense float64 attention."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import reference, validation
from pagedserve.kernels.validation import CHECK_ARGS_ENV
from tests.kernels.paged_batch import (
    MIXED,
    Batch,
    attend,
    check_close_to_float64,
    dense_attention,
    make_batch,
)


def run(batch: Batch, scale: float, **kwargs) -> torch.Tensor:
    return attend(reference, batch, scale, **kwargs)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size"), [(4, 4, 16), (9, 3, 4), (8, 2, 8)]
)
def test_mixed_batch_matches_dense(num_heads, num_kv_heads, block_size, head_dim):
    batch = make_batch(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=head_dim + num_heads,
    )
    scale = 1 / math.sqrt(head_dim)
    got = run(batch, scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, dense_attention(batch, scale).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("seqs", "block_size"),
    [
        ([(5, 1), (0, 1), (31, 1), (32, 1), (9, 1)], 32),  # decode only
        ([(0, 12)] * 4, 8),  # prefill only, equal lengths: q is used in place
        ([(0, 12), (0, 3), (0, 7)], 4),  # prefill only, ragged
        ([(6, 4)] * 3, 16),  # extend only, equal lengths
        ([(0, 1)], 4),  # a single 1-token context
    ],
)
def test_single_kind_batches_match_dense(seqs, block_size):
    batch = make_batch(seqs, num_heads=6, num_kv_heads=2, head_dim=64, block_size=block_size)
    torch.testing.assert_close(
        run(batch, 0.125), dense_attention(batch, 0.125).float(), atol=1e-5, rtol=1e-5
    )


def test_far_apart_contexts_are_batched_separately_and_match_dense():
    # Decode contexts 3, 300, 6 and extend contexts 3, 294: each kind splits into two batches.
    seqs = [(2, 1), (299, 1), (0, 3), (290, 4), (5, 1)]
    assert reference._buckets([0, 1, 4], [3, 300, 3, 294, 6]) == [[0, 4], [1]]
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=13)
    torch.testing.assert_close(
        run(batch, 0.125), dense_attention(batch, 0.125).float(), atol=1e-5, rtol=1e-5
    )


def test_buckets_cut_only_where_padding_would_double_the_work():
    # One batch keeps the caller's order.
    assert reference._buckets([2, 0, 1], [100, 150, 200]) == [[2, 0, 1]]
    assert reference._buckets([0, 1], [1, 2 * 1 + 128]) == [[0, 1]]
    # Sorted by context; a batch is cut when a context exceeds 2 x its first + 128.
    assert reference._buckets([0, 1, 2, 3], [3, 300, 10, 728]) == [[0, 2], [1, 3]]
    assert reference._buckets([0, 1, 2, 3], [3, 300, 10, 729]) == [[0, 2], [1], [3]]
    assert reference._buckets([], [5]) == []


@pytest.mark.parametrize("sliding_window", [1, 4, 11])
def test_sliding_window_matches_dense(sliding_window):
    batch = make_batch(MIXED, num_heads=8, num_kv_heads=1, head_dim=64, block_size=8, seed=3)
    want = dense_attention(batch, 0.125, sliding_window).float()
    got = run(batch, 0.125, sliding_window=sliding_window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The window changes the answer (else this test could not fail).
    assert not torch.allclose(got, dense_attention(batch, 0.125).float(), atol=1e-3)


@pytest.mark.parametrize("seqs", [[(40, 1), (57, 1), (90, 1)], [(40, 3), (61, 5)]])
def test_a_window_far_behind_skips_the_blocks_before_it(seqs):
    """Decode and extend batches whose windows all start past block 0: the blocks before the
    earliest window are left out of the gather, and the result is still the dense one."""
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=4)
    want = dense_attention(batch, 0.2, 6).float()
    torch.testing.assert_close(run(batch, 0.2, sliding_window=6), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 11])
@pytest.mark.parametrize(
    "seqs",
    [MIXED, [(0, 12), (0, 12), (0, 5)], [(0, 1), (7, 1), (40, 1)]],
    ids=["mixed", "prefill", "decode"],
)
def test_softcap_matches_dense(seqs, sliding_window):
    # Gemma 2's logit soft-capping, GQA 4. Scale 0.3 gives scores of a few units, which a cap of
    # 2 bends a lot: the capped answer is far from the uncapped one.
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=8, seed=17)
    want = dense_attention(batch, 0.3, sliding_window, softcap=2.0).float()
    got = run(batch, 0.3, sliding_window=sliding_window, softcap=2.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, run(batch, 0.3, sliding_window=sliding_window), atol=1e-2)


def test_scale_is_applied_as_given():
    batch = make_batch(MIXED, num_heads=3, num_kv_heads=3, head_dim=64, block_size=16, seed=5)
    torch.testing.assert_close(
        run(batch, 0.7), dense_attention(batch, 0.7).float(), atol=1e-5, rtol=1e-5
    )


def test_bfloat16_close_to_float64():
    # bf16 keeps 8 significant bits (relative step 2**-8 ~ 4e-3); outputs are weighted means of
    # N(0, 1) values, so 2e-2 absolute/relative bounds the rounding of q, K, V, P and the output.
    check_close_to_float64(run, MIXED, torch.bfloat16, 2e-2)


def test_out_is_filled_and_returned():
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=4, seed=7)
    out = torch.full_like(batch.q, float("nan"))
    got = run(batch, 0.125, out=out)
    assert got is out
    torch.testing.assert_close(out, dense_attention(batch, 0.125).float(), atol=1e-5, rtol=1e-5)


def test_non_contiguous_q_as_split_from_qkv():
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=9)
    n = batch.q.shape[0]
    qkv = torch.cat([batch.q.reshape(n, -1), torch.randn(n, 2 * 2 * 64)], dim=1)
    q = qkv[:, : 4 * 64].view(n, 4, 64)
    assert not q.is_contiguous()
    got = reference.paged_attention(
        q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        0.125,
    )
    torch.testing.assert_close(got, dense_attention(batch, 0.125).float(), atol=1e-5, rtol=1e-5)


def test_sequence_without_new_tokens_is_skipped():
    batch = make_batch([(4, 3), (6, 2)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    # A middle sequence with 4 cached tokens and none new owns no rows of q or of the output.
    got = reference.paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables[[0, 0, 1]],
        torch.tensor([7, 4, 8], dtype=torch.int32),
        torch.tensor([0, 3, 3, 5], dtype=torch.int32),
        0.125,
    )
    torch.testing.assert_close(got, dense_attention(batch, 0.125).float(), atol=1e-5, rtol=1e-5)


def test_empty_batch():
    batch = make_batch([(4, 3)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    empty = reference.paged_attention(
        batch.q[:0],
        batch.k_cache,
        batch.v_cache,
        batch.block_tables[:0],
        batch.seq_lens[:0],
        batch.query_start_loc[:1],
        0.125,
    )
    assert empty.shape == (0, 2, 64)


def test_module_functions_dispatch_to_reference(monkeypatch):
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=11)
    want = run(batch, 0.125)
    for env in ("torch", "TORCH "):
        monkeypatch.setenv(kernels.BACKEND_ENV, env)
        assert kernels.select_backend(batch.q.device) == "torch"
        got = attend(kernels, batch, 0.125)
        assert torch.equal(got, want)


def test_unknown_backend_is_rejected(monkeypatch):
    monkeypatch.setenv(kernels.BACKEND_ENV, "cuda-magic")
    with pytest.raises(ValueError, match="PAGEDSERVE_ATTENTION_BACKEND='cuda-magic'.*torch"):
        kernels.reshape_and_cache(
            torch.zeros(1, 1, 4),
            torch.zeros(1, 1, 4),
            torch.zeros(2, 2, 1, 4),
            torch.zeros(2, 2, 1, 4),
            torch.zeros(1, dtype=torch.int64),
        )


# ------------------------------------------------------------------- Gemma's norm and GeGLU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unit_offset_norms_equal_gemma3_rms_norm_exactly(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(0)
    hf = Gemma3RMSNorm(640, eps=1e-6).to(dtype)  # Gemma stores weight - 1: small values
    hf.weight.data = (torch.randn(640, generator=gen) * 0.3).to(dtype)
    x = (torch.randn(7, 640, generator=gen) * 3).to(dtype)
    residual = torch.randn(7, 640, generator=gen).to(dtype)
    with torch.no_grad():
        assert torch.equal(reference.rms_norm(x, hf.weight, 1e-6, unit_offset=True), hf(x))
        hf_sum = residual + x
        out, new_residual = reference.fused_add_rms_norm(
            x, residual, hf.weight, 1e-6, unit_offset=True
        )
        assert torch.equal(new_residual, hf_sum)
        assert torch.equal(out, hf(hf_sum))
        # Not the Llama norm: (1 + weight) instead of weight, and one rounding.
        assert not torch.equal(out, reference.rms_norm(hf_sum, hf.weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gelu_tanh_and_mul_equals_transformers_geglu_exactly(dtype):
    from transformers.activations import ACT2FN

    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(5, 2 * 96, generator=gen) * 3).to(dtype)
    gate, up = gate_up[:, :96], gate_up[:, 96:]
    got = reference.gelu_tanh_and_mul(gate_up)
    assert torch.equal(got, ACT2FN["gelu_pytorch_tanh"](gate) * up)
    assert not torch.equal(got, reference.silu_and_mul(gate_up))


# ---------------------------------------------------------------------------- reshape_and_cache


def test_reshape_and_cache_writes_exact_slots_and_skips_negative():
    num_blocks, block_size, heads, dim = 5, 4, 2, 3
    k_cache = torch.randn(num_blocks, block_size, heads, dim)
    v_cache = torch.randn(num_blocks, block_size, heads, dim)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = [13, -1, 0, 19, 7, -5, 8]  # slot 19 = last offset of the last block
    key = torch.randn(len(slots), heads, dim)
    value = torch.randn(len(slots), heads, dim)

    kernels.reshape_and_cache(key, value, k_cache, v_cache, torch.tensor(slots))

    k_flat, v_flat = k_cache.view(-1, heads, dim), v_cache.view(-1, heads, dim)
    written = {s: i for i, s in enumerate(slots) if s >= 0}
    for slot in range(num_blocks * block_size):
        if slot in written:
            assert torch.equal(k_flat[slot], key[written[slot]])
            assert torch.equal(v_flat[slot], value[written[slot]])
        else:
            assert torch.equal(k_flat[slot], k_before.view(-1, heads, dim)[slot])
            assert torch.equal(v_flat[slot], v_before.view(-1, heads, dim)[slot])
    assert torch.equal(k_cache[3, 1], key[0])  # slot 13 = block 3, offset 1


def test_reshape_and_cache_all_padding_and_empty():
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    kv = torch.ones(3, 1, 8)
    kernels.reshape_and_cache(kv, kv, k_cache, v_cache, torch.tensor([-1, -1, -1]))
    kernels.reshape_and_cache(kv[:0], kv[:0], k_cache, v_cache, torch.zeros(0, dtype=torch.int64))
    assert not k_cache.any() and not v_cache.any()


def test_reshape_and_cache_into_a_view_of_a_combined_cache():
    kv_cache = torch.zeros(2, 3, 4, 2, 8)  # [K/V, num_blocks, block_size, Hkv, D]
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    kernels.reshape_and_cache(key, value, kv_cache[0], kv_cache[1], torch.tensor([5, 11]))
    assert torch.equal(kv_cache[0, 1, 1], key[0]) and torch.equal(kv_cache[0, 2, 3], key[1])
    assert torch.equal(kv_cache[1, 1, 1], value[0]) and torch.equal(kv_cache[1, 2, 3], value[1])
    assert kv_cache.count_nonzero() == key.count_nonzero() + value.count_nonzero()


# ---------------------------------------------------------------------------------- validation


def _cache_args(**over):
    args = dict(
        key=torch.zeros(3, 2, 8),
        value=torch.zeros(3, 2, 8),
        k_cache=torch.zeros(4, 4, 2, 8),
        v_cache=torch.zeros(4, 4, 2, 8),
        slot_mapping=torch.tensor([0, 1, 2]),
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"key": torch.zeros(3, 16)}, r"key must be \[num_tokens, num_kv_heads, head_dim\]"),
        ({"value": torch.zeros(3, 2, 4)}, r"value shape \(3, 2, 4\) differs from key shape"),
        ({"key": torch.zeros(3, 3, 8), "value": torch.zeros(3, 3, 8)}, "key has 3 kv heads"),
        ({"v_cache": torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16)}, "v_cache dtype"),
        ({"slot_mapping": torch.tensor([0, 1, 2], dtype=torch.int32)}, "slot_mapping must be"),
        ({"slot_mapping": torch.tensor([0, 1])}, "slot_mapping has 2 entries for 3 tokens"),
        ({"slot_mapping": torch.tensor([0, 16, 3])}, "holds slot 16, but the cache has only 16"),
        (
            {"k_cache": torch.zeros(4, 8, 2, 8)[:, :4]},
            "k_cache must have its block and offset dims contiguous",
        ),
        (
            {"key": torch.zeros(3, 2, 8, dtype=torch.bfloat16)},
            "key/value dtypes .* must match the cache dtype",
        ),
    ],
)
def test_reshape_and_cache_rejects_bad_arguments(over, message):
    with pytest.raises(ValueError, match=message):
        reference.reshape_and_cache(**_cache_args(**over))


def _attention_args(**over):
    # 2 sequences: 3 new tokens over 5 cached, and 1 new token over 2 cached.
    args = dict(
        q=torch.zeros(4, 6, 8),
        k_cache=torch.zeros(4, 4, 2, 8),
        v_cache=torch.zeros(4, 4, 2, 8),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        seq_lens=torch.tensor([8, 3], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        scale=0.5,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"q": torch.zeros(4, 9, 8)}, "q has 9 heads, not a multiple of k_cache's 2 kv heads"),
        ({"q": torch.zeros(4, 48)}, r"q must be \[num_tokens, num_heads, head_dim\]"),
        ({"q": torch.zeros(4, 6, 16)}, "q has head_dim 16, but k_cache has head_dim 8"),
        ({"q": torch.zeros(4, 6, 8, dtype=torch.bfloat16)}, "q dtype torch.bfloat16 differs"),
        ({"k_cache": torch.zeros(4, 4, 16)}, r"k_cache must be \[num_blocks, block_size"),
        ({"v_cache": torch.zeros(4, 4, 1, 8)}, "v_cache shape .* differs from k_cache shape"),
        (
            {"query_start_loc": torch.tensor([0, 3, 4, 4], dtype=torch.int32)},
            "query_start_loc must have num_seqs \\+ 1 = 3 entries, got 4",
        ),
        ({"query_start_loc": torch.tensor([0, 3, 4])}, "query_start_loc must be torch.int32"),
        ({"seq_lens": torch.tensor([8, 3, 1], dtype=torch.int32)}, "seq_lens has 3 entries but"),
        ({"block_tables": torch.tensor([[0, 1], [2, 3]])}, "block_tables must be torch.int32"),
        ({"seq_lens": torch.tensor([[8, 3]], dtype=torch.int32)}, "seq_lens must be 1-D"),
        ({"scale": torch.tensor(0.5)}, "scale must be a Python float"),
        ({"sliding_window": 0}, "sliding_window must be None or a positive int, got 0"),
        ({"softcap": 0.0}, "softcap must be None or a positive float, got 0.0"),
        ({"softcap": True}, "softcap must be None or a positive float, got True"),
        ({"out": torch.zeros(4, 6, 4)}, r"out must be \(4, 6, 8\) torch.float32 like q"),
        ({"out": torch.zeros(6, 4, 8).transpose(0, 1)}, "out must be contiguous"),
        (
            {"query_start_loc": torch.tensor([0, 3, 5], dtype=torch.int32)},
            "query_start_loc must run from 0 to num_tokens = 4, got 0 .. 5",
        ),
        (
            {
                "query_start_loc": torch.tensor([0, 5, 4], dtype=torch.int32),
                "q": torch.zeros(4, 6, 8),
            },
            r"query_start_loc must be non-decreasing, but entry 2 \(4\) < entry 1 \(5\)",
        ),
        (
            {"seq_lens": torch.tensor([2, 3], dtype=torch.int32)},
            "sequence 0 has 3 new tokens but seq_len 2",
        ),
        (
            {"seq_lens": torch.tensor([8, 9], dtype=torch.int32)},
            "sequence 1 has seq_len 9, but a block-table row holds only 2 blocks x 4 = 8 tokens",
        ),
    ],
)
def test_paged_attention_rejects_bad_arguments(over, message):
    with pytest.raises(ValueError, match=message):
        reference.paged_attention(**_attention_args(**over))


def test_paged_attention_accepts_the_valid_arguments_above():
    out = reference.paged_attention(**_attention_args())
    assert out.shape == (4, 6, 8) and not out.isnan().any()


def test_paged_attention_rejects_mixed_devices():
    # The meta device stands in for a GPU here: the check must fire before any data is read.
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        reference.paged_attention(**_attention_args(q=torch.zeros(4, 6, 8, device="meta")))


# --------------------------------------------------------------------------- the debug switch


@pytest.mark.parametrize(("switch", "checked"), [(None, False), ("0", False), ("1", True)])
def test_argument_checks_run_only_behind_the_debug_switch(switch, checked):
    # A weight in another dtype than x: the checks refuse it; unchecked, torch just promotes.
    code = (
        "import torch\n"
        "from pagedserve.kernels import reference\n"
        "out = reference.rms_norm(torch.ones(2, 8), torch.ones(8, dtype=torch.float64), 1e-6)\n"
        "print(out.dtype)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != CHECK_ARGS_ENV}
    if switch is not None:
        env[CHECK_ARGS_ENV] = switch
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    if checked:
        assert done.returncode == 1
        assert "ValueError: weight dtype torch.float64 differs from x dtype torch.float32" in (
            done.stderr
        )
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "torch.float64"


def test_the_tests_run_with_the_checks_on():
    assert validation.CHECK_ARGS
