"""The compiled CPU paged-attention kernel (`kernels.cpu_ops`, kernels/csrc/cpu_attention.cpp)
against dense float64 attention and the torch reference, on the grid the Triton tests use: block
sizes, head dims (64 and 128 compiled as constants, 80 through the generic loop), GQA ratios,
sliding windows, soft-capping and mixed batches.

The kernel is built by the first test that needs it, into this run's cache folder (tests/conftest.py
sets PAGEDSERVE_CACHE_DIR), as on a fresh clone. The `kernel_only` fixture lifts the dispatch
limit (cpu_ops.KERNEL_MAX_NEW_TOKENS), so prefills and extends go through the kernel too instead
of the reference's SDPA.

Tolerances: float32 1e-5 (as for the reference and Triton); bfloat16 2e-2 and float16 5e-3 against
float64, the bounds of `tests/kernels/test_reference.py` (8 and 11 significant bits in q, K, V and
the output; the kernel's softmax and sums are float32).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve import kernels
from pagedserve.kernels import cpu_features, cpu_ops, reference
from tests.kernels.paged_batch import (
    MIXED,
    Batch,
    attend,
    check_empty_step_and_int64_seq_lens,
    dense_attention,
    make_batch,
)

TOL = dict(atol=1e-5, rtol=1e-5)
# GQA groups of 1, 2, 3, 4, 7 and 8 query heads: the kernel takes a group's rows together, up to
# 4 at a time (2 at head_dim 128), so groups of 7 and 8 split.
HEADS = [(4, 4), (6, 3), (9, 3), (8, 2), (14, 2), (16, 2)]
# The flags of an x86-64-v4 CPU (/proc/cpuinfo names).
_V4 = "avx avx2 fma bmi1 bmi2 f16c abm movbe xsave avx512f avx512bw avx512cd avx512dq avx512vl"


@pytest.fixture
def kernel_only(monkeypatch):
    monkeypatch.setattr(cpu_ops, "KERNEL_MAX_NEW_TOKENS", 1 << 30)


def run(batch: Batch, scale: float, **kwargs) -> torch.Tensor:
    return attend(cpu_ops, batch, scale, **kwargs)


def check(got: torch.Tensor, batch: Batch, scale: float, sliding_window=None, softcap=None) -> None:
    want = dense_attention(batch, scale, sliding_window, softcap).float()
    torch.testing.assert_close(got, want, **TOL)
    ref = attend(reference, batch, scale, sliding_window=sliding_window, softcap=softcap)
    torch.testing.assert_close(got, ref, **TOL)


def test_the_kernel_is_built_and_is_the_cpu_default(monkeypatch):
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    assert cpu_ops.available()
    library = cpu_ops.loaded()
    features = cpu_features.cpu_features()
    if library.origin == "prebuilt":  # `python -m pagedserve.kernels.cpu_ops --prebuilt` ran here
        assert library.path.parent == cpu_ops.PREBUILT_DIR and features.at_least(library.level)
    else:
        assert library.path == cpu_ops.library_path() and library.path.is_file()
        assert library.path.parent == kernels.paths.cache_dir() / "kernels"
        assert library.level == features.level
        assert library.march == cpu_features.kernel_flags()
    assert kernels.select_backend(torch.device("cpu")) == "cpu"
    assert kernels.get_backend("cpu") is cpu_ops
    params = inspect.signature(cpu_ops.paged_attention).parameters
    assert params == inspect.signature(reference.paged_attention).parameters


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_mixed_batch_matches_dense_and_reference(
    num_heads, num_kv_heads, block_size, head_dim, kernel_only
):
    batch = make_batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, seed=block_size + head_dim)  # fmt: skip
    scale = 1 / math.sqrt(head_dim)
    check(run(batch, scale), batch, scale)


def test_which_sequences_the_kernel_takes(batch_variant):
    # With PAGEDSERVE_BATCH_VARIANT=1 (by default the kernel takes every sequence): decodes and
    # extends of up to 4 tokens always; longer ones while their (new token, key)
    # pairs stay within the dtype's limit: a 128-token prompt in any dtype, 200 tokens in float32
    # but not bf16, no 512-token prompt, no 64-token extend over 2000 cached tokens. With AMX,
    # bf16 sequences of head_dim 64 and 128 at any length (the tile products).
    def attends(q_len, seq_len, dtype, head_dim=64):
        return cpu_ops.kernel_attends(q_len, seq_len, dtype, head_dim)

    assert attends(1, 100_000, torch.bfloat16) and attends(4, 5000, torch.float32)
    assert attends(128, 128, torch.bfloat16) and attends(128, 128, torch.float32)
    assert attends(200, 200, torch.float32) and not attends(200, 200, torch.bfloat16, 80)
    assert not attends(512, 512, torch.float32) and not attends(64, 2064, torch.float32)
    assert not attends(512, 512, torch.float16, 128)
    amx = cpu_ops.amx_tiles()
    assert attends(200, 200, torch.bfloat16) == amx
    assert attends(2048, 2048, torch.bfloat16, 128) == amx
    assert attends(64, 2064, torch.bfloat16) == amx
    assert cpu_ops.KERNEL_MAX_PAIRS[torch.bfloat16] == 16384


def test_default_dispatch_sends_long_prefills_to_the_reference(monkeypatch, batch_variant):
    # The sequences kernel_attends refuses go to SDPA, one call per sequence, the rest to the
    # kernel in one call; the result is the same either way.
    seqs = [(3000, 1), (0, 128), (0, 512), (2000, 64), (0, 200), (7, 3)]
    batch = make_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=2)
    calls = []
    real = reference.paged_attention

    def spy(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(reference, "paged_attention", spy)
    got = run(batch, 0.125)
    assert calls == [512, 64]
    monkeypatch.setattr(reference, "paged_attention", real)
    check(got, batch, 0.125)


def test_prompt_spanning_many_tiles_and_a_4k_prefix(kernel_only):
    # 300 new tokens = 19 work items of up to 16 tokens per KV head; a 4k-key extend.
    batch = make_batch([(700, 300), (0, 130), (4000, 40), (33, 7)], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=32, seed=4)  # fmt: skip
    check(run(batch, 0.125), batch, 0.125)


@pytest.mark.parametrize("sliding_window", [1, 4, 11, 70, 5000])
def test_sliding_window(sliding_window, kernel_only):
    # Windows shorter than a block, across blocks and tiles, and longer than any context.
    seqs = [*MIXED, (150, 40), (300, 1)]
    batch = make_batch(seqs, num_heads=6, num_kv_heads=2, head_dim=64, block_size=8, seed=3)
    got = run(batch, 0.125, sliding_window=sliding_window)
    check(got, batch, 0.125, sliding_window)
    if sliding_window < 150:  # else the window changes nothing
        assert not torch.allclose(got, dense_attention(batch, 0.125).float(), atol=1e-3)


@pytest.mark.parametrize("sliding_window", [None, 100])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("threads", [2, 3])
def test_one_decoding_stream_is_split_by_keys(sliding_window, softcap, threads, batch_variant):
    """One stream's decode is an item per KV head, too few for the threads: each is split by keys
    into parts of 64 keys or more (kernels/csrc/cpu_attention.cpp `split_decodes`), merged after.
    127 keys: one part; 128: two; 200 and 999: as many as the threads want, block ends and not;
    with a window, the parts cover the window's keys."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for context in (127, 128, 200, 999):
            batch = make_batch([(context, 1)], num_heads=6, num_kv_heads=2, head_dim=64,
                               block_size=16, seed=context)  # fmt: skip
            got = run(batch, 0.3, sliding_window=sliding_window, softcap=softcap)
            check(got, batch, 0.3, sliding_window, softcap)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, head_dim", [((9, 3), 64), ((8, 2), 64), ((4, 4), 128)])
def test_a_decode_reads_the_cache_in_place_as_an_extend_reads_it_converted(
    dtype, heads, head_dim, kernel_only
):
    """A decode item whose GQA group fits one pass of rows reads its keys and values straight
    from the cache, converting them as it loads them; an item of two tokens converts each block
    into buffers first. The same floats in the same order: the last token's output is the same,
    bit for bit, either way (window and soft-capping too)."""
    batch = make_batch([(15, 2), (40, 2), (130, 2), (301, 2)], num_heads=heads[0],
                       num_kv_heads=heads[1], head_dim=head_dim, block_size=16, dtype=dtype,
                       seed=head_dim)  # fmt: skip
    last = batch.query_start_loc[1:].long() - 1
    decode = dict(q=batch.q[last].contiguous(), query_start_loc=torch.arange(5, dtype=torch.int32))
    for options in ({}, {"sliding_window": 50, "softcap": 3.0}):
        extend = run(batch, 0.2, **options)[last]
        got = cpu_ops.paged_attention(
            decode["q"], batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
            decode["query_start_loc"], 0.2, **options,
        )  # fmt: skip
        assert torch.equal(got, extend)


@pytest.mark.parametrize("sliding_window", [None, 7])
def test_softcap(sliding_window, kernel_only):
    # Scale 0.3 gives scores of a few units, which a cap of 2 bends hard.
    batch = make_batch([*MIXED, (130, 1)], num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=16, seed=14)  # fmt: skip
    got = run(batch, 0.3, sliding_window=sliding_window, softcap=2.0)
    check(got, batch, 0.3, sliding_window, 2.0)
    assert not torch.allclose(got, dense_attention(batch, 0.3, sliding_window).float(), atol=1e-2)


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)], ids=["bf16", "fp16"]
)
@pytest.mark.parametrize("seqs", [MIXED, [(0, 1), (40, 1), (300, 1)]], ids=["extend", "decode"])
def test_half_dtypes_close_to_float64(dtype, tol, seqs, kernel_only):
    batch = make_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=128, block_size=16, dtype=dtype)
    scale = 1 / math.sqrt(128)
    got = run(batch, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), dense_attention(batch, scale).float(), atol=tol,
                               rtol=tol)  # fmt: skip


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    seqs=st.lists(
        st.tuples(st.integers(0, 150), st.integers(0, 20)), min_size=1, max_size=5
    ).filter(lambda seqs: all(c + n > 0 for c, n in seqs) and any(n > 0 for _, n in seqs)),
    heads=st.sampled_from(HEADS),
    block_size=st.sampled_from([1, 8, 16, 32]),
    sliding_window=st.one_of(st.none(), st.integers(1, 100)),
    limit=st.sampled_from([1, 4, 1 << 30]),
)
def test_random_batches_match_dense(seqs, heads, block_size, sliding_window, limit):
    # Any mix of cached and new lengths (new = 0 included), under any dispatch limit.
    batch = make_batch(
        seqs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64, block_size=block_size,
        seed=len(seqs),
    )  # fmt: skip
    want = dense_attention(batch, 0.125, sliding_window).float()
    saved = cpu_ops.KERNEL_MAX_NEW_TOKENS
    cpu_ops.KERNEL_MAX_NEW_TOKENS = limit
    try:
        got = run(batch, 0.125, sliding_window=sliding_window)
    finally:
        cpu_ops.KERNEL_MAX_NEW_TOKENS = saved
    torch.testing.assert_close(got, want, **TOL)


_AMX = pytest.mark.skipif(
    not cpu_ops.amx_tiles(),
    reason="the tile path needs AMX-BF16 (a native build on Intel Sapphire Rapids or later); "
    "without it bf16 prefills take the vector path, which the other bf16 cases here cover",
)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@_AMX
@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 120), st.integers(1, 70)), min_size=1, max_size=4),
    heads=st.sampled_from(HEADS),
    head_dim=st.sampled_from([64, 128]),
    block_size=st.sampled_from([1, 8, 16, 32]),
    sliding_window=st.one_of(st.none(), st.integers(1, 90)),
)
def test_amx_tiles_match_dense(seqs, heads, head_dim, block_size, sliding_window, batch_variant):
    # Prefills and extends in bf16 of 16 rows or more (new tokens x GQA group) take the tiles
    # (`kernel_attends` gives them all to the kernel where AMX is):
    # every split of a sequence's keys into chunks of 32 and of its rows into tiles of 16 (the
    # last ones partial), scattered blocks, windows that end inside a chunk.
    batch = make_batch(
        seqs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
        block_size=block_size, dtype=torch.bfloat16, seed=len(seqs),
    )  # fmt: skip
    scale = 1 / math.sqrt(head_dim)
    got = run(batch, scale, sliding_window=sliding_window).float()
    want = dense_attention(batch, scale, sliding_window).float()
    torch.testing.assert_close(got, want, **BF16_TOL)


@_AMX
def test_amx_tiles_with_every_kv_head_in_one_item(batch_variant):
    # With at least 4 sequences per thread an item takes all of a sequence's KV heads (its
    # tokens' rows of each head in turn), as in the engine's prefill steps of many prompts.
    shapes = [(0, 40), (7, 33), (0, 128), (60, 16), (0, 17), (5, 50), (0, 64), (90, 20)]
    seqs = [shapes[i % len(shapes)] for i in range(4 * torch.get_num_threads() + 2)]
    batch = make_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                       dtype=torch.bfloat16, seed=4)  # fmt: skip
    got = run(batch, 0.125).float()
    torch.testing.assert_close(got, dense_attention(batch, 0.125).float(), **BF16_TOL)


@_AMX
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_amx_tiles_softcap_and_long_prompts(sliding_window, kernel_only, batch_variant):
    # A 300-token prompt (10 chunks of keys, 57 row tiles per KV head) and a capped one.
    batch = make_batch([(0, 300), (40, 33)], num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype=torch.bfloat16, seed=3)  # fmt: skip
    for softcap in (None, 2.0):
        got = run(batch, 0.3, sliding_window=sliding_window, softcap=softcap).float()
        want = dense_attention(batch, 0.3, sliding_window, softcap).float()
        torch.testing.assert_close(got, want, **BF16_TOL)
    assert not torch.allclose(got, dense_attention(batch, 0.3, sliding_window).float(), atol=0.1)


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, TOL), (torch.bfloat16, dict(atol=2e-2, rtol=2e-2))],
    ids=["fp32", "bf16"],
)
def test_unwritten_slots_are_never_read(dtype, tol, kernel_only):
    # NaN in every slot that holds no key of a sequence (the rest of each last block included):
    # one load of it would turn an output into NaN. bf16 takes the AMX tiles where they are.
    seqs = [*MIXED, (0, 40), (25, 30)]
    batch = make_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=1,
                       dtype=dtype)  # fmt: skip
    block_size = batch.k_cache.shape[1]
    keep = torch.zeros(batch.k_cache.shape[:2], dtype=torch.bool)
    for table, seq_len in zip(batch.block_tables.tolist(), batch.seq_lens.tolist(), strict=True):
        for p in range(seq_len):
            keep[table[p // block_size], p % block_size] = True
    batch.k_cache[~keep] = float("nan")
    batch.v_cache[~keep] = float("nan")
    got = run(batch, 0.125).float()
    torch.testing.assert_close(got, dense_attention(batch, 0.125).float(), **tol)


def test_out_non_contiguous_q_and_a_combined_cache(kernel_only):
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=9)
    n = batch.q.shape[0]
    qkv = torch.cat([batch.q.reshape(n, -1), torch.randn(n, 2 * 2 * 64)], dim=1)
    q = qkv[:, : 4 * 64].view(n, 4, 64)
    assert not q.is_contiguous()
    kv = torch.stack([batch.k_cache, batch.v_cache])  # one [2, blocks, ...] allocation
    out = torch.full_like(batch.q, float("nan"))
    got = cpu_ops.paged_attention(
        q, kv[0], kv[1], batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.125, out=out
    )
    assert got is out
    check(out, batch, 0.125)


@pytest.mark.parametrize("seqs", [[(0, 3)], [(1, 1)], [(0, 4), (2, 1), (1, 2)]])
def test_tables_one_block_wide_whatever_their_entry_stride(seqs):
    """A table one block wide has no second entry to step to, so any entry stride will do (as
    kernels/validation.py says; torch calls one such row contiguous). A lone request's table of a
    model with two KV groups came so (engine/worker/model_runner.py `_send`)."""
    batch = make_batch(seqs, num_heads=4, num_kv_heads=1, head_dim=64, block_size=4, seed=11)
    width = batch.block_tables.shape[1]  # one block and make_batch's padding
    tables = batch.block_tables[:, ::width]
    assert tables.shape[1] == 1 and tables.stride(1) == width
    got = cpu_ops.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, tables, batch.seq_lens, batch.query_start_loc, 0.125
    )
    check(got, batch, 0.125)


def test_fp8_caches_use_the_reference():
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=5)
    scale = torch.tensor([0.05])
    k8 = kernels.quantize_kv(batch.k_cache, scale, torch.float8_e4m3fn)
    v8 = kernels.quantize_kv(batch.v_cache, scale, torch.float8_e4m3fn)
    args = (batch.q, k8, v8, batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.125)
    got = cpu_ops.paged_attention(*args, k_scale=scale, v_scale=scale)
    want = reference.paged_attention(*args, k_scale=scale, v_scale=scale)
    assert torch.equal(got, want)


def test_empty_batch_and_bad_arguments():
    batch = check_empty_step_and_int64_seq_lens(cpu_ops)
    with pytest.raises(ValueError, match="sequence 0 has seq_len 99, but a block-table row holds"):
        cpu_ops.paged_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
            torch.tensor([99], dtype=torch.int32), batch.query_start_loc, 0.125,
        )  # fmt: skip


FALLBACK = (
    "WARNING paged attention, RMSNorm, residual add + RMSNorm, SiLU-and-multiply and rotary + KV "
    "write fall back to the slower torch reference, and GGUF weights are dequantized at load: "
)


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in env.items() if k != kernels.BACKEND_ENV}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip


def test_without_a_compiler_the_reference_is_used_with_a_warning(tmp_path):
    # A fresh cache folder, no prebuilt libraries and CXX pointing at nothing: no build is
    # attempted, one warning says why, the "auto" backend on CPU is torch, and cpu_ops still
    # answers (through the reference).
    code = f"""
import logging, torch
from pathlib import Path
from pagedserve import kernels
from pagedserve.kernels import cpu_ops, reference
from tests.kernels.paged_batch import MIXED, make_batch
cpu_ops.PREBUILT_DIR = Path({str(tmp_path / "prebuilt")!r})
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
b = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.125)
print("backend", kernels.select_backend(torch.device("cpu")))
print("equal", torch.equal(cpu_ops.paged_attention(*args), reference.paged_attention(*args)))
print("available", cpu_ops.available())
"""
    env = dict(os.environ, CXX=str(tmp_path / "no-compiler"), PAGEDSERVE_CACHE_DIR=str(tmp_path))
    done = _run(code, env)
    assert done.stdout.split("\n")[:3] == ["backend torch", "equal True", "available False"]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert warnings == [
        FALLBACK + "no C++ compiler found (set CXX, or install g++) and no prebuilt or cached "
        "library of the kernels"
    ]
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())


def test_a_damaged_build_is_reported_and_the_reference_used(tmp_path):
    code = f"""
import logging, torch
from pathlib import Path
from pagedserve import kernels
from pagedserve.kernels import cpu_ops
cpu_ops.PREBUILT_DIR = Path({str(tmp_path / "prebuilt")!r})
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
path = cpu_ops.library_path()
path.parent.mkdir(parents=True)
path.write_bytes(b"not a shared library")
print("backend", kernels.select_backend(torch.device("cpu")))
"""
    done = _run(code, dict(os.environ, PAGEDSERVE_CACHE_DIR=str(tmp_path)))
    assert done.stdout.strip() == "backend torch"
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and warnings[0].startswith(FALLBACK)
    assert "not loaded (delete it to rebuild)" in warnings[0]


def test_a_missing_header_is_reported_and_the_reference_used(tmp_path, monkeypatch, caplog):
    # The sources of an install that lost a file: finding the library (its name hashes every
    # source and header) fails before any build, with one warning, not an exception.
    for source in cpu_ops.SOURCES:
        (tmp_path / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(cpu_ops, "SOURCES", tuple(tmp_path / s.name for s in cpu_ops.SOURCES))
    monkeypatch.setattr(cpu_ops, "HEADERS", (tmp_path / "cpu_math.h",))
    with caplog.at_level(logging.WARNING, logger="pagedserve.kernels.cpu_ops"):
        assert cpu_ops.loaded.__wrapped__() is None  # the process's own library stays loaded
    assert [r.getMessage() for r in caplog.records] == [
        FALLBACK.removeprefix("WARNING ") + "the kernels' sources are incomplete ([Errno 2] No "
        f"such file or directory: '{tmp_path / 'cpu_math.h'}')"
    ]


def test_prebuilt_libraries_come_first_the_chosen_level_then_lower(tmp_path, monkeypatch):
    # The loading order, on empty files of the right names (tests/engine/test_lesser_cpu.py
    # builds and loads real ones): the chosen level's, each lower level's, then the cached build.
    monkeypatch.setattr(cpu_ops, "PREBUILT_DIR", tmp_path)
    amx = cpu_features.features_from(f"flags : {_V4} amx_bf16", "x86_64")
    monkeypatch.setattr(cpu_features, "cpu_features", lambda: amx)
    assert cpu_ops._prebuilt_candidates() == []
    for level in ("avx2", "avx512_bf16"):
        cpu_ops.prebuilt_path(level).touch()
    (tmp_path / "pagedserve_cpu_avx512_0123456789abcdef.so").touch()  # stale: another source
    found = cpu_ops._prebuilt_candidates()
    assert [(c.level, c.origin, c.march) for c in found] == [
        ("avx512_bf16", "prebuilt", ("-march=x86-64-v4", "-mavx512bf16")),
        ("avx2", "prebuilt", ("-march=x86-64-v3",)),
    ]
    assert found[0].path.name.startswith("pagedserve_cpu_avx512_bf16_")
    # A forced lesser level never loads a library above it.
    forced = cpu_features.features_from(f"flags : {_V4} amx_bf16", "x86_64", "avx512")
    monkeypatch.setattr(cpu_features, "cpu_features", lambda: forced)
    assert [c.level for c in cpu_ops._prebuilt_candidates()] == ["avx2"]
