"""The attention scenarios: decode (over the cache in --dtype, and over an fp8 one) and prefill,
the paged kernel checked against the reference and timed against SDPA on contiguous K/V."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.gpu_kernels import harness
from benchmarks.gpu_kernels.plans import DecodeCase, HeadShape, PrefillCase
from pagedserve.kernels import reference
from pagedserve.kernels.fp8 import FP8_KV_DTYPES, kv_scale_from_amax, quantize_kv

FP8_KV = "fp8"  # the fp8 decode cases' cache: FP8_KV_DTYPES["fp8"], e4m3


@dataclass
class PagedBatch:
    """One step's tensors twice: paged for the kernels, contiguous for SDPA, same values."""

    q: torch.Tensor  # [num_seqs * q_len, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    q_sdpa: torch.Tensor  # [num_seqs, H, q_len, D]
    k: torch.Tensor  # [num_seqs, Hkv, seq_len, D]
    v: torch.Tensor

    def paged_args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
        )


def build_batch(
    setup: harness.Setup, shape: HeadShape, num_seqs: int, seq_len: int, q_len: int, seed: int
) -> PagedBatch:
    """Every sequence holds `seq_len` tokens, the last `q_len` of them new.

    Sequence b's logical block j is physical block block_tables[b, j], a random permutation of
    all blocks, so position p of sequence b sits in slot
        block_tables[b, p // block_size] * block_size + p % block_size.
    The cache holds exactly the sequences' blocks; slots past a sequence's end stay zero.
    """
    device, dtype = setup.device, setup.dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    h, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=device, dtype=dtype)

    k, v = randn(num_seqs, hkv, seq_len, d), randn(num_seqs, hkv, seq_len, d)
    q_sdpa = randn(num_seqs, h, q_len, d)
    blocks_per_seq = math.ceil(seq_len / harness.BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    block_ids = torch.randperm(num_blocks, generator=gen, device=device).view(num_seqs, -1)
    positions = torch.arange(seq_len, device=device)
    slots = (
        block_ids[:, positions // harness.BLOCK_SIZE] * harness.BLOCK_SIZE
        + positions % harness.BLOCK_SIZE
    ).flatten()
    caches = []
    for dense in (k, v):
        cache = torch.zeros(num_blocks, harness.BLOCK_SIZE, hkv, d, device=device, dtype=dtype)
        cache.view(-1, hkv, d)[slots] = dense.transpose(1, 2).reshape(-1, hkv, d)
        caches.append(cache)
    return PagedBatch(
        q=q_sdpa.transpose(1, 2).reshape(num_seqs * q_len, h, d),
        k_cache=caches[0],
        v_cache=caches[1],
        block_tables=block_ids.to(torch.int32),
        seq_lens=torch.full((num_seqs,), seq_len, device=device, dtype=torch.int32),
        query_start_loc=torch.arange(
            0, (num_seqs + 1) * q_len, q_len, device=device, dtype=torch.int32
        ),
        q_sdpa=q_sdpa,
        k=k,
        v=v,
    )


def decode_label(shape: HeadShape, case: DecodeCase) -> harness.Record:
    name = f"{shape.name} b{case.batch} ctx{case.context}"
    return harness.case_record("decode", name, shape, batch=case.batch, context=case.context)


def prefill_label(shape: HeadShape, case: PrefillCase) -> harness.Record:
    name = f"{shape.name} {case.num_seqs}x{case.new_tokens} +{case.prefix}"
    return harness.case_record(
        "prefill", name, shape,
        num_seqs=case.num_seqs, new_tokens=case.new_tokens, prefix=case.prefix,
    )  # fmt: skip


def _checked_attention(
    report: harness.Report, setup: harness.Setup, b: PagedBatch, scale: float, label: harness.Record
) -> tuple[Callable[[], object], torch.Tensor]:
    """The kernel's paged attention over `b` as a call that writes `out`, for timing; run once
    first and checked against the reference under `label`."""
    out = torch.empty_like(b.q)

    def call() -> object:
        return setup.kernels.paged_attention(*b.paged_args(), scale, out=out)

    call()
    harness.check(report, label, [(out, reference.paged_attention(*b.paged_args(), scale))])
    return call, out


def run_decode(
    report: harness.Report,
    setup: harness.Setup,
    shape: HeadShape,
    case: DecodeCase,
    window: int | None,
    fp8: bool = False,
) -> None:
    """Check, then time, one decode step; with `window`, also check sliding-window attention;
    with `fp8`, the same step over an fp8 cache too (`run_decode_fp8`)."""
    label = decode_label(shape, case)
    kernels, device = setup.kernels, setup.device
    b = build_batch(setup, shape, case.batch, case.context, 1, seed=case.batch + case.context)
    scale = shape.head_dim**-0.5
    call, out = _checked_attention(report, setup, b, scale, label | {"sliding_window": None})
    if window is not None:
        got = kernels.paged_attention(*b.paged_args(), scale, sliding_window=window)
        want = reference.paged_attention(*b.paged_args(), scale, sliding_window=window)
        case_name = f"{label['case']} window{window}"
        harness.check(report, label | {"case": case_name, "sliding_window": window}, [(got, want)])
        del got, want

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(b.q_sdpa, b.k, b.v, scale=scale, enable_gqa=True)

    sdpa_err = harness.max_abs_err(sdpa().view(b.q.shape), out)
    t, t_sdpa = (
        harness.time_us(call, device, setup.cuda_graph),
        harness.time_us(sdpa, device, setup.cuda_graph),
    )
    kv_bytes = b.k.numel() * b.k.element_size() * 2
    report.emit(
        {"kind": "decode", **label, "kv_dtype": _dtype_name(setup.dtype), "kv_bytes": kv_bytes}
        | {"time_us": round(t, 2), "gbps": harness.significant(kv_bytes / t / 1e3)}
        | {
            "sdpa_time_us": round(t_sdpa, 2),
            "sdpa_gbps": harness.significant(kv_bytes / t_sdpa / 1e3),
        }
        | {"sdpa_max_abs_err": sdpa_err}
        | harness.speed_fields(t, t_sdpa, case.target)
    )
    if fp8:
        run_decode_fp8(report, setup, b, shape, label, t, out)


def run_decode_fp8(
    report: harness.Report,
    setup: harness.Setup,
    b: PagedBatch,
    shape: HeadShape,
    label: harness.Record,
    base_t: float,
    base_out: torch.Tensor,
) -> None:
    """The decode step of `b` over an fp8 copy of its cache, scaled as the engine scales it
    (`kv_scale_from_amax`): checked against the reference on the same fp8 cache; checked again
    after the scales change in place, replaying the same call (the same CUDA graph with
    --cuda-graph); then timed against the kernel over the cache in --dtype (`base_t`, its output
    `base_out`)."""
    kernels, device = setup.kernels, setup.device
    fp8_dtype = FP8_KV_DTYPES[FP8_KV]
    k_scale = kv_scale_from_amax(b.k_cache.abs().amax(), fp8_dtype)
    v_scale = kv_scale_from_amax(b.v_cache.abs().amax(), fp8_dtype)
    k_cache = quantize_kv(b.k_cache, k_scale, fp8_dtype)
    v_cache = quantize_kv(b.v_cache, v_scale, fp8_dtype)
    args = (b.q, k_cache, v_cache, b.block_tables, b.seq_lens, b.query_start_loc)
    scale = shape.head_dim**-0.5
    fp8_label = label | {"case": f"{label['case']} {FP8_KV}", "kv_dtype": FP8_KV}
    out = torch.empty_like(b.q)

    def call() -> object:
        return kernels.paged_attention(*args, scale, out=out, k_scale=k_scale, v_scale=v_scale)

    def want() -> torch.Tensor:
        return reference.paged_attention(*args, scale, k_scale=k_scale, v_scale=v_scale)

    call()
    harness.check(report, fp8_label | {"sliding_window": None}, [(out, want())])
    quantization_err = harness.max_abs_err(out, base_out)
    replay = harness.graph_replay(call) if setup.cuda_graph else call
    # Powers of two, so undoing them restores the calibrated scales exactly.
    k_scale.mul_(0.5)
    v_scale.mul_(2.0)
    out.fill_(float("nan"))
    replay()
    rescaled = fp8_label | {"case": f"{fp8_label['case']} rescaled", "sliding_window": None}
    harness.check(report, rescaled | {"cuda_graph": setup.cuda_graph}, [(out, want())])
    k_scale.mul_(2.0)
    v_scale.mul_(0.5)
    del replay

    t = harness.time_us(call, device, setup.cuda_graph)
    kv_bytes = b.k.numel() * k_cache.element_size() * 2  # one byte per element, K and V
    report.emit(
        {"kind": "decode", **fp8_label, "kv_bytes": kv_bytes}
        | {"time_us": round(t, 2), "gbps": harness.significant(kv_bytes / t / 1e3)}
        | {"base_kv_dtype": _dtype_name(setup.dtype), "base_time_us": round(base_t, 2)}
        | {"base_gbps": harness.significant(b.k.numel() * b.k.element_size() * 2 / base_t / 1e3)}
        | {"time_vs_base": harness.significant(t / base_t), "base_max_abs_err": quantization_err}
        | harness.speed_fields(t, base_t, None)
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bool_lower_right(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] mask: new token j, at position kv_len - q_len + j, sees keys 0 .. its own."""
    keys = torch.arange(kv_len, device=device)
    positions = torch.arange(kv_len - q_len, kv_len, device=device)
    return keys[None, :] <= positions[:, None]


def visible_pairs(new_tokens: int, prefix: int) -> int:
    """(query, key) pairs a causal mask lets through: new token j (position prefix + j) sees
    prefix + j + 1 keys."""
    return new_tokens * prefix + new_tokens * (new_tokens + 1) // 2


def causal_sdpa(
    b: PagedBatch, scale: float, prefix: int
) -> tuple[Callable[[], torch.Tensor], str, torch.Tensor]:
    """SDPA over the contiguous copy of `b` with each new token seeing the prefix and the new
    tokens up to itself; returns the call, the name of the mask it uses and one output.

    causal_lower_right lets SDPA's flash / efficient kernels skip the masked tiles without a
    materialized mask; a boolean mask (older torch, or a backend that refuses the bias) sends
    SDPA to a slower masked kernel, so the records name the mask used.
    """
    n, device = b.q_sdpa.shape[2], b.q.device
    mask: object = None
    mask_name = "is_causal"
    if prefix:
        try:
            from torch.nn.attention.bias import causal_lower_right

            mask, mask_name = causal_lower_right(n, prefix + n), "causal_lower_right"
        except ImportError:
            mask, mask_name = _bool_lower_right(n, prefix + n, device), "bool"

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            b.q_sdpa, b.k, b.v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )

    try:
        sdpa_out = sdpa()
    except (RuntimeError, ValueError) as exc:
        if mask_name != "causal_lower_right":
            raise
        mask, mask_name = _bool_lower_right(n, prefix + n, device), f"bool ({exc!r:.80})"
        sdpa_out = sdpa()
    return sdpa, mask_name, sdpa_out


def run_prefill(
    report: harness.Report, setup: harness.Setup, shape: HeadShape, case: PrefillCase
) -> None:
    """Check, then time, a step of `num_seqs` prompts of `new_tokens` on `prefix` cached tokens."""
    n, prefix = case.new_tokens, case.prefix
    label = prefill_label(shape, case)
    device = setup.device
    b = build_batch(setup, shape, case.num_seqs, prefix + n, n, seed=n + prefix)
    scale = shape.head_dim**-0.5
    call, out = _checked_attention(report, setup, b, scale, label)

    sdpa, mask_name, sdpa_out = causal_sdpa(b, scale, prefix)
    sdpa_err = harness.max_abs_err(sdpa_out.transpose(1, 2).reshape(b.q.shape), out)
    del sdpa_out
    t, t_sdpa = (
        harness.time_us(call, device, setup.cuda_graph),
        harness.time_us(sdpa, device, setup.cuda_graph),
    )
    flops = 4 * shape.head_dim * shape.num_heads * visible_pairs(n, prefix) * case.num_seqs
    report.emit(
        {"kind": "prefill", **label, "flops": flops}
        | {"time_us": round(t, 2), "tflops": harness.significant(flops / t / 1e6)}
        | {
            "sdpa_time_us": round(t_sdpa, 2),
            "sdpa_tflops": harness.significant(flops / t_sdpa / 1e6),
        }
        | {"sdpa_mask": mask_name, "sdpa_max_abs_err": sdpa_err}
        | harness.speed_fields(t, t_sdpa, case.target)
    )
