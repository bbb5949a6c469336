"""The cache scenarios: reshape_and_cache ("cache") and copy_blocks ("copy"), checked exactly
against the torch reference and timed against it."""

from __future__ import annotations

import math

import torch

from benchmarks.gpu_kernels import harness
from benchmarks.gpu_kernels.plans import HeadShape
from pagedserve.kernels import reference


def cache_label(shape: HeadShape, num_tokens: int) -> harness.Record:
    return harness.case_record(
        "cache", f"{shape.name} {num_tokens} tokens", shape, num_tokens=num_tokens
    )


def run_cache(
    report: harness.Report, setup: harness.Setup, shape: HeadShape, num_tokens: int
) -> None:
    """Check (exact), then time, writing `num_tokens` tokens' K/V to a random permutation of the
    cache's slots."""
    label = cache_label(shape, num_tokens)
    kernels, device, dtype = setup.kernels, setup.device, setup.dtype
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    size = (num_tokens, shape.num_kv_heads, shape.head_dim)
    key = torch.randn(size, generator=gen, device=device, dtype=dtype)
    value = torch.randn(size, generator=gen, device=device, dtype=dtype)
    num_blocks = math.ceil(num_tokens / harness.BLOCK_SIZE)
    num_slots = num_blocks * harness.BLOCK_SIZE
    slot_mapping = torch.randperm(num_slots, generator=gen, device=device)[:num_tokens]
    cache_shape = (num_blocks, harness.BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    caches = [torch.zeros(cache_shape, device=device, dtype=dtype) for _ in range(4)]

    def call() -> None:
        kernels.reshape_and_cache(key, value, caches[0], caches[1], slot_mapping)

    def ref() -> None:
        reference.reshape_and_cache(key, value, caches[2], caches[3], slot_mapping)

    call()
    ref()
    harness.check(
        report, label, [(caches[0], caches[2]), (caches[1], caches[3])], atol=0.0, rtol=0.0
    )
    t, t_ref = harness.time_us(call, device), harness.time_us(ref, device)
    written = 2 * key.numel() * key.element_size()
    report.emit(
        {"kind": "cache", **label, "bytes_written": written}
        | {"time_us": round(t, 2), "gbps": harness.significant(written / t / 1e3)}
        | {"ref_time_us": round(t_ref, 2), "ref_gbps": harness.significant(written / t_ref / 1e3)}
        | harness.speed_fields(t, t_ref, None)
    )


def copy_label(
    shape: HeadShape, num_layers: int, pool_blocks: int, num_copies: int
) -> harness.Record:
    return harness.case_record(
        "copy", f"{shape.name} {num_layers} layers copy{num_copies}", shape,
        num_layers=num_layers, num_caches=2 * num_layers, num_blocks=pool_blocks,
        num_copies=num_copies,
    )  # fmt: skip


def run_copy(
    report: harness.Report,
    setup: harness.Setup,
    shape: HeadShape,
    num_layers: int,
    pool_blocks: int,
    n: int,
) -> None:
    """Check (exact, every cache), then time, copying `n` random blocks of the pool to `n` other
    random blocks in each of the layers' K and V caches."""
    label = copy_label(shape, num_layers, pool_blocks, n)
    kernels, device, dtype = setup.kernels, setup.device, setup.dtype
    gen = torch.Generator(device=device).manual_seed(n)
    blocks = torch.randperm(pool_blocks, generator=gen, device=device)
    src, dst = blocks[:n], blocks[n : 2 * n]
    cache_shape = (pool_blocks, harness.BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    caches = [
        torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
        for _ in range(2 * num_layers)
    ]
    ref_caches = [cache.clone() for cache in caches]

    # The copies are idempotent (no block is both a source and a destination), so every timed
    # call does the same work.
    def call() -> None:
        kernels.copy_blocks(caches, src, dst)

    def ref() -> None:
        reference.copy_blocks(ref_caches, src, dst)

    call()
    ref()
    harness.check(report, label, zip(caches, ref_caches, strict=True), atol=0.0, rtol=0.0)
    t, t_ref = harness.time_us(call, device), harness.time_us(ref, device)
    block_bytes = caches[0][0].numel() * caches[0].element_size()
    moved = 2 * n * len(caches) * block_bytes  # each block read once, written once
    report.emit(
        {"kind": "copy", **label, "block_bytes": block_bytes, "bytes": moved}
        | {"time_us": round(t, 2), "gbps": harness.significant(moved / t / 1e3)}
        | {"ref_time_us": round(t_ref, 2), "ref_gbps": harness.significant(moved / t_ref / 1e3)}
        | harness.speed_fields(t, t_ref, None)
    )
