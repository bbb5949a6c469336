"""Paged attention test batches: a step laid out as the model runner lays it out, with the cache
filled through `reference.reshape_and_cache`, and a float64 dense attention to compare against.
Shared by the reference and the Triton kernel tests."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import pytest
import torch

from pagedserve.kernels import reference

GARBAGE_BLOCK_ID = 1_000_000  # fills unused block-table entries: must never be read


@dataclass
class Batch:
    """One attention step laid out as the model runner lays it out, plus the dense K/V."""

    q: torch.Tensor  # [num_new_tokens, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32
    seq_lens: torch.Tensor  # int32
    query_start_loc: torch.Tensor  # int32
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], every position
    values: list[torch.Tensor]
    q_lens: list[int]


def attend(ops, batch: Batch, scale: float, **kwargs) -> torch.Tensor:
    """`ops.paged_attention` (a backend module, or `kernels` itself) of the batch's step."""
    return ops.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
        batch.query_start_loc, scale, **kwargs,
    )  # fmt: skip


def check_empty_step_and_int64_seq_lens(ops) -> Batch:
    """What every backend's wrapper shares: a step of no sequences gives an empty result, and the
    shared validation runs first, with the reference's messages. Returns the one-sequence batch
    for the backend's own argument checks."""
    batch = make_batch([(4, 3)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=4)
    empty = ops.paged_attention(
        batch.q[:0], batch.k_cache, batch.v_cache, batch.block_tables[:0], batch.seq_lens[:0],
        batch.query_start_loc[:1], 0.125,
    )  # fmt: skip
    assert empty.shape == (0, 2, 64)
    with pytest.raises(ValueError, match="seq_lens must be torch.int32"):
        attend(ops, replace(batch, seq_lens=batch.seq_lens.long()), 0.125)
    return batch


def check_close_to_float64(run, seqs, dtype: torch.dtype, tol: float) -> None:
    """`run(batch, scale)` at GQA 3 and head_dim 128 in `dtype` against float64 attention, within
    `tol` absolute and relative: the rounding of q, K, V, P and the output in that dtype."""
    batch = make_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=128, block_size=16, dtype=dtype)
    scale = 1 / math.sqrt(128)
    got = run(batch, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(
        got.float(), dense_attention(batch, scale).float(), atol=tol, rtol=tol
    )


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    return block_table[position // block_size] * block_size + position % block_size


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """`seqs` lists (num_cached, q_len) per sequence. Physical blocks are a random permutation, so
    each sequence's blocks are scattered; the cache is filled by reshape_and_cache in two steps
    (the cached prefixes, then this step's new tokens) from slot mappings built from the tables."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [math.ceil((c + n) / block_size) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks no sequence owns
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    max_blocks = max(blocks_per_seq) + 2  # every row has padding entries
    tables = []
    for n in blocks_per_seq:
        own, physical = physical[:n], physical[n:]
        tables.append(own + [GARBAGE_BLOCK_ID] * (max_blocks - n))

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Unwritten slots hold finite noise, as a reused block would.
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    keys, values = [], []
    for c, n in seqs:
        keys.append(torch.randn(c + n, num_kv_heads, head_dim, generator=gen).to(dtype))
        values.append(torch.randn(c + n, num_kv_heads, head_dim, generator=gen).to(dtype))

    for step in ("cached", "new"):
        slots, ks, vs = [], [], []
        for (c, n), table, k, v in zip(seqs, tables, keys, values, strict=True):
            span = range(c) if step == "cached" else range(c, c + n)
            slots += [slot_of(table, p, block_size) for p in span]
            ks.append(k[list(span)])
            vs.append(v[list(span)])
        reference.reshape_and_cache(
            torch.cat(ks), torch.cat(vs), k_cache, v_cache, torch.tensor(slots, dtype=torch.int64)
        )

    q_lens = [n for _, n in seqs]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return Batch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        keys=keys,
        values=values,
        q_lens=q_lens,
    )


def dense_attention(
    batch: Batch,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Naive float64 causal attention of each sequence's new tokens over its contiguous K/V; with
    `softcap`, each score s is capped to softcap * tanh(s / softcap) before the mask."""
    num_heads = batch.q.shape[1]
    outs = []
    start = 0
    for k, v, q_len in zip(batch.keys, batch.values, batch.q_lens, strict=True):
        seq_len = k.shape[0]
        group = num_heads // k.shape[1]
        q = batch.q[start : start + q_len].double()  # [T, H, D]
        start += q_len
        k = k.double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        key = torch.arange(seq_len)[None, :]
        visible = key <= pos
        if sliding_window is not None:
            visible &= key > pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hts,shd->thd", scores.softmax(-1), v))
    return torch.cat(outs)


# (num_cached, q_len): decode at and across block edges, a 1-token context, a fresh prefill, and
# extends whose new tokens cross blocks; listed out of kind order so the groups interleave.
MIXED = [(0, 7), (13, 1), (20, 5), (0, 1), (16, 1), (3, 18), (8, 1), (31, 2), (5, 9)]


@dataclass
class Stream:
    """One sequence's q, k and v at every position: a step attends a span of its positions."""

    q: torch.Tensor  # [length, H, D]
    k: torch.Tensor  # [length, Hkv, D]
    v: torch.Tensor


def random_stream(
    length: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> Stream:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(length, h, head_dim, generator=gen).to(dtype)
        for h in (num_heads, num_kv_heads, num_kv_heads)
    )
    return Stream(q, k, v)


def step_of(spans: list[tuple[Stream, int, int]], *, block_size: int, seed: int = 0) -> Batch:
    """One step over given streams: positions [start, end) of each are its new tokens, over its
    keys [0, end), written by reshape_and_cache to a random permutation of blocks (unwritten
    slots hold finite noise), so that the same stream can be attended in different steps."""
    rng = random.Random(seed)
    first = spans[0][0]
    blocks_per_seq = [math.ceil(end / block_size) for _, _, end in spans]
    physical = list(range(sum(blocks_per_seq) + 3))
    rng.shuffle(physical)
    tables = []
    for n in blocks_per_seq:
        own, physical = physical[:n], physical[n:]
        tables.append(own + [GARBAGE_BLOCK_ID] * (max(blocks_per_seq) + 1 - n))
    shape = (sum(blocks_per_seq) + 3, block_size, *first.k.shape[1:])
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(shape, generator=gen).to(first.k.dtype)
    v_cache = torch.randn(shape, generator=gen).to(first.k.dtype)
    keys = [stream.k[:end] for stream, _, end in spans]
    values = [stream.v[:end] for stream, _, end in spans]
    slots = [
        slot_of(table, p, block_size)
        for table, k in zip(tables, keys, strict=True)
        for p in range(len(k))
    ]
    reference.reshape_and_cache(
        torch.cat(keys), torch.cat(values), k_cache, v_cache, torch.tensor(slots)
    )
    q_lens = [end - start for _, start, end in spans]
    return Batch(
        q=torch.cat([stream.q[start:end] for stream, start, end in spans]),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor([len(k) for k in keys], dtype=torch.int32),
        query_start_loc=torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
        keys=keys,
        values=values,
        q_lens=q_lens,
    )
