"""GPU benchmark of the Triton kernels: correctness against the torch reference first, then speed
against torch's own kernels, both measured side by side in one run.

    python -m pagedserve.bench.gpu_kernels                        # every case on a CUDA device
    python -m pagedserve.bench.gpu_kernels --only decode,cache --out $OUT/kernels.jsonl
    python -m pagedserve.bench.gpu_kernels --only fused           # the fused layer ops alone
    python -m pagedserve.bench.gpu_kernels --only copy            # copy_blocks alone
    python -m pagedserve.bench.gpu_kernels --only moe             # the fused MoE alone
    python -m pagedserve.bench.gpu_kernels --sweep                # launch configurations instead
    TRITON_INTERPRET=1 python -m pagedserve.bench.gpu_kernels --smoke   # tiny shapes, also on CPU

Scenarios, in bf16 (--dtype) over a paged cache of block size 16 whose blocks lie in a random
permutation (the scatter a long-running server's block pool ends up with):

  decode   one new token per sequence, every sequence `context` tokens long. Memory-bound, so it
           is reported as K/V bytes read per second, against SDPA reading the same K/V from
           contiguous [B, Hkv, L, D] tensors (the best a paged kernel can hope to match).
           For the Llama-3.1-8B cases also over an fp8 (e4m3) cache of the same K/V, scaled by
           `kv_scale_from_amax` (a second "decode" record, kv_dtype "fp8"): bytes/s at one byte
           per element, and its time against the kernel over the bf16 cache (`time_vs_base`;
           `ratio` is the speed-up). Checked against the reference on the same fp8 cache, and
           once more after the scales change in place (as the engine's calibration changes them),
           through the same CUDA graph with --cuda-graph: the kernels must read the scales from
           memory at every call.
  prefill  8 sequences of new tokens, with no prefix and on a 2048-token cached prefix.
           Compute-bound, so it is reported as TFLOP/s over the (query, key) pairs the causal mask
           lets through, against SDPA on contiguous tensors with the same causal mask.
  cache    reshape_and_cache of 65536 tokens to a random permutation of slots: GB/s of K and V
           written, against the torch reference (index_copy_).
  copy     copy_blocks, the copy-on-write of shared blocks, of 1, 64 and 256 blocks in each of
           32 layers' K and V caches (Llama-3.1-8B heads) at once, between random blocks of a
           1024-block pool: GB/s of the bytes moved (each block read once and written once),
           against the torch reference (index_select + index_copy_ per cache). Eager, as the
           Triton wrapper copies the caches' addresses from the host on every call.
  fused    the decoder's non-attention ops (`kernels.triton_fused`: rms_norm, fused_add_rms_norm,
           silu_and_mul, rotary_and_cache) at Llama-3.2-1B's layer shape for 1, 256 and 4096
           tokens. Memory-bound: GB/s of the bytes each op must move (its inputs read once, its
           outputs written once), against the torch reference of the same op and against the
           unfused torch code the model ran before the fused ops ("model": an out-of-place
           residual add before the norm; rotary on the stacked q/k view, then the attention
           backend's reshape_and_cache), timed eagerly. Checked to 2 ulps of the dtype, see
           FUSED_RTOL.
  moe      the experts of a mixture-of-experts layer (`kernels.triton_moe.fused_moe`) at
           Qwen3-30B-A3B's (hidden 2048, experts of 768, 128 experts, top 8) and Mixtral-8x7B's
           (4096, 14336, 8, top 2) shapes for 1, 16 and 256 tokens routed by `moe_route` on
           random logits. TFLOP/s over the active parameters (2 x 3 x I x hidden per token and
           expert), against the torch reference (a loop over the experts that received tokens)
           and against the dense layer of the same active size and FLOPs (one [T, hidden] x
           [hidden, 2 x I x top_k] matmul, SiLU-and-multiply, one [T, I x top_k] x
           [I x top_k, hidden] matmul); GB/s of the distinct experts' weights read in the JSON.
           Eager (the reference syncs with the host).

Before it is timed, each case's Triton output is compared with `kernels.reference` in the same
dtype on the same device (attention: |triton - ref| <= ATOL + RTOL * |ref|; the cache write must
match exactly, and so must every cache after copy_blocks). A failed check, or a case that raises,
is reported and the run goes on. Timing is do_bench's median on CUDA; on CPU (--smoke) a
wall-clock median that only proves the path runs.

stdout carries one JSON line per record (the environment, each check, each measurement; `--out`
writes the same lines to a file) and the summary table goes to stderr, so stdout stays parseable.
Exit status: 0 every check passed, 1 a check failed or a case raised, 2 nothing could run. Speed
targets are reported (`target`, `ok`) but do not change the exit status.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import torch
import torch.nn.functional as F

from pagedserve.kernels import reference
from pagedserve.kernels.fp8 import FP8_KV_DTYPES, kv_scale_from_amax, quantize_kv
from pagedserve.kernels.triton_attention import KernelConfig

KERNELS_MODULE = "pagedserve.kernels.triton_attention"
SCENARIOS = ("decode", "prefill", "cache", "copy", "fused", "moe")
FUSED_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_and_cache")
FUSED_KERNELS_MODULE = "pagedserve.kernels.triton_fused"
MOE_KERNELS_MODULE = "pagedserve.kernels.triton_moe"
SWEEP_SCENARIOS = ("decode", "prefill")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP8_KV = "fp8"  # the fp8 decode cases' cache: FP8_KV_DTYPES["fp8"], e4m3
BLOCK_SIZE = 16
# bf16 outputs of magnitude 2..4 have an ulp of 0.0156: two correct kernels may differ by one ulp.
ATOL = 2e-2
RTOL = 1.6e-2  # torch.testing's default for bf16
CPU_TIMING_ITERS = 3  # the interpreter is slow; the CPU timing only proves the path runs
# The fused ops round where the reference rounds: an intermediate one ulp off (silu, the
# normalised x) is at most two ulps after the product with up or the weight. Relative to the
# dtype's epsilon (float32: 1e-5, for the GPU's approximate exp and rsqrt).
FUSED_ATOL = 1e-5
FUSED_RTOL = {torch.bfloat16: 2 * 2**-7, torch.float16: 2 * 2**-10, torch.float32: 1e-5}
ROPE_THETA = 500000.0  # Llama 3

Record = dict[str, Any]


@dataclass(frozen=True)
class HeadShape:
    """Attention head layout of one model."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


LLAMA_8B = HeadShape("llama-3.1-8b", 32, 8, 128)
LLAMA_1B = HeadShape("llama-3.2-1b", 32, 8, 64)
SMOLLM2 = HeadShape("smollm2", 9, 3, 64)
TINY = HeadShape("tiny", 4, 2, 64)


@dataclass(frozen=True)
class LayerShape:
    """The sizes of one decoder layer that the fused ops see."""

    heads: HeadShape
    hidden_size: int
    intermediate_size: int
    max_positions: int


LLAMA_1B_LAYER = LayerShape(LLAMA_1B, 2048, 8192, 131072)
TINY_LAYER = LayerShape(TINY, 96, 160, 256)  # rows that are not powers of two


@dataclass(frozen=True)
class MoeShape:
    """The experts of one mixture-of-experts layer."""

    name: str
    hidden_size: int
    intermediate_size: int  # one expert's
    num_experts: int
    top_k: int
    renormalize: bool  # the top-k weights, as the model's router does


QWEN3_30B_A3B_MOE = MoeShape("qwen3-30b-a3b", 2048, 768, 128, 8, True)
MIXTRAL_8X7B_MOE = MoeShape("mixtral-8x7b", 4096, 14336, 8, 2, True)
TINY_MOE = MoeShape("tiny-moe", 96, 80, 8, 2, True)  # not multiples of the tiles


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    context: int
    target: float | None  # minimum triton/SDPA bandwidth ratio


@dataclass(frozen=True)
class PrefillCase:
    num_seqs: int
    new_tokens: int
    prefix: int
    target: float | None  # minimum triton/SDPA TFLOP/s ratio


@dataclass(frozen=True)
class Plan:
    """The cases one run checks and measures."""

    decode_shapes: tuple[HeadShape, ...]
    decode_cases: tuple[DecodeCase, ...]
    # Sliding-window attention is checked (not timed) once, on this (shape, batch, context).
    window_case: tuple[HeadShape, int, int]
    # Decode shapes also run over an fp8 cache (every decode case), against the kernel over the
    # cache in --dtype.
    fp8_decode_shapes: tuple[HeadShape, ...]
    sliding_window: int
    prefill_shapes: tuple[HeadShape, ...]
    prefill_cases: tuple[PrefillCase, ...]
    cache_shape: HeadShape
    cache_tokens: int
    # copy_blocks: each of copy_counts blocks per call, in each of copy_layers x (K, V) caches of
    # copy_pool_blocks blocks (at least twice the most copies: sources and destinations differ)
    copy_shape: HeadShape
    copy_layers: int
    copy_pool_blocks: int
    copy_counts: tuple[int, ...]
    fused_layer: LayerShape
    fused_tokens: tuple[int, ...]
    moe_shapes: tuple[MoeShape, ...]
    moe_tokens: tuple[int, ...]
    # --sweep: launch configurations timed on these cases (see run_sweep)
    sweep_decode: tuple[tuple[HeadShape, DecodeCase], ...] = ()
    sweep_prefill: tuple[tuple[HeadShape, PrefillCase], ...] = ()
    sweep_splits: tuple[int, ...] = ()
    decode_configs: tuple[KernelConfig, ...] = ()
    prefill_configs: tuple[KernelConfig, ...] = ()


FULL = Plan(
    decode_shapes=(LLAMA_8B, LLAMA_1B, SMOLLM2),
    decode_cases=(
        DecodeCase(1, 8192, 0.70),
        DecodeCase(32, 2048, None),
        DecodeCase(64, 2048, 0.90),
        DecodeCase(256, 1024, 0.90),
    ),
    window_case=(LLAMA_8B, 32, 2048),
    fp8_decode_shapes=(LLAMA_8B,),
    sliding_window=1024,
    prefill_shapes=(LLAMA_8B, LLAMA_1B),
    prefill_cases=(PrefillCase(8, 2048, 0, 0.60), PrefillCase(8, 512, 2048, 0.60)),
    cache_shape=LLAMA_8B,
    cache_tokens=65536,
    copy_shape=LLAMA_8B,
    copy_layers=32,
    copy_pool_blocks=1024,  # 64 caches x 1024 blocks x 32 KiB: 2 GiB, twice (Triton, reference)
    copy_counts=(1, 64, 256),
    fused_layer=LLAMA_1B_LAYER,
    fused_tokens=(1, 256, 4096),
    moe_shapes=(QWEN3_30B_A3B_MOE, MIXTRAL_8X7B_MOE),
    moe_tokens=(1, 16, 256),
    sweep_decode=(
        (LLAMA_8B, DecodeCase(1, 8192, 0.70)),
        (LLAMA_8B, DecodeCase(64, 2048, 0.90)),
        (LLAMA_1B, DecodeCase(256, 1024, 0.90)),
        (SMOLLM2, DecodeCase(64, 2048, 0.90)),
    ),
    sweep_prefill=(
        (LLAMA_8B, PrefillCase(8, 2048, 0, 0.60)),
        (LLAMA_1B, PrefillCase(8, 512, 2048, 0.60)),
    ),
    sweep_splits=(4, 8, 16, 32, 64),
    decode_configs=tuple(
        KernelConfig(tile, warps, stages)
        for tile, warps, stages in [
            (32, 2, 4),
            (32, 4, 4),
            (64, 4, 2),
            (64, 4, 3),
            (64, 4, 4),
            (64, 8, 3),
            (128, 4, 2),
            (128, 4, 3),
            (128, 8, 3),
            (256, 8, 2),
        ]
    ),  # fmt: skip
    prefill_configs=tuple(
        KernelConfig(tile, warps, stages, block_m)
        for block_m, tile, warps, stages in [
            (128, 64, 8, 2),
            (128, 64, 8, 3),
            (128, 128, 8, 2),
            (128, 32, 4, 3),
            (128, 64, 4, 3),
            (64, 64, 4, 3),
            (64, 128, 4, 2),
            (64, 32, 4, 4),
        ]
    ),  # fmt: skip
)

# Tiny shapes that run in seconds under TRITON_INTERPRET=1; no speed targets.
SMOKE = Plan(
    decode_shapes=(TINY,),
    decode_cases=(DecodeCase(2, 64, None),),
    window_case=(TINY, 2, 64),
    fp8_decode_shapes=(TINY,),
    sliding_window=32,
    prefill_shapes=(TINY,),
    prefill_cases=(PrefillCase(2, 32, 0, None), PrefillCase(2, 32, 32, None)),
    cache_shape=TINY,
    cache_tokens=256,
    copy_shape=TINY,
    copy_layers=2,
    copy_pool_blocks=8,
    copy_counts=(1, 3),
    fused_layer=TINY_LAYER,
    fused_tokens=(1, 5),
    moe_shapes=(TINY_MOE,),
    moe_tokens=(1, 12),  # 16-row tiles, then 64 (more tokens than experts)
    sweep_decode=((TINY, DecodeCase(2, 64, None)),),
    sweep_prefill=((TINY, PrefillCase(2, 32, 32, None)),),
    sweep_splits=(2,),
    decode_configs=(KernelConfig(32, 4, 2), KernelConfig(64, 4, 3)),
    prefill_configs=(KernelConfig(32, 4, 2, 32), KernelConfig(64, 4, 2, 64)),
)


@dataclass(frozen=True)
class Setup:
    """What every case runs on: the module under test, the device, the dtype, the timer."""

    kernels: ModuleType
    device: torch.device
    dtype: torch.dtype
    cuda_graph: bool = False  # time attention (not the cache write) as CUDA-graph replays
    fused_kernels: ModuleType | None = None  # the fused ops under test (the "fused" scenario)
    moe_kernels: ModuleType | None = None  # the fused MoE under test (the "moe" scenario)


class Report:
    """Collects the records, prints each as a JSON line and copies it to `sink`."""

    def __init__(self, sink: TextIO | None) -> None:
        self.records: list[Record] = []
        self.failed = False
        self._sink = sink

    def emit(self, record: Record) -> None:
        self.records.append(record)
        if record["kind"] == "error" or (record["kind"] == "check" and not record["ok"]):
            self.failed = True
        line = json.dumps(record)
        print(line, flush=True)
        if self._sink is not None:
            self._sink.write(line + "\n")
            self._sink.flush()


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
    setup: Setup, shape: HeadShape, num_seqs: int, seq_len: int, q_len: int, seed: int
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
    blocks_per_seq = math.ceil(seq_len / BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    block_ids = torch.randperm(num_blocks, generator=gen, device=device).view(num_seqs, -1)
    positions = torch.arange(seq_len, device=device)
    slots = (block_ids[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).flatten()
    caches = []
    for dense in (k, v):
        cache = torch.zeros(num_blocks, BLOCK_SIZE, hkv, d, device=device, dtype=dtype)
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


def time_us(fn: Callable[[], object], device: torch.device, graph: bool = False) -> float:
    """Median time of one call in microseconds.

    CUDA: triton's do_bench (CUDA events around each call, L2 flushed before it, default warmup
    and rep), so K/V come from HBM as in a model, where other layers' weights evict them. Host
    launch cost overlaps the flush, unless it exceeds the flush's ~70 us; with `graph`, do_bench
    times a CUDA-graph replay of `fn` instead, as the engine replays decode steps.
    CPU: wall-clock median of a few calls after one warm-up.
    """
    if device.type == "cuda":
        import triton.testing

        timed = _graph_replay(fn) if graph else fn
        return float(triton.testing.do_bench(timed, return_mode="median")) * 1e3
    fn()
    samples = []
    for _ in range(CPU_TIMING_ITERS):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def _graph_replay(fn: Callable[[], object]) -> Callable[[], None]:
    """Capture one call of `fn` in a CUDA graph (after warm-up calls on a side stream, which
    compile and allocate outside the capture) and return its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        fn()
    return cuda_graph.replay


def _sig(x: float) -> float:
    """x to 4 significant digits: rates span 0.001 (CPU smoke) to 5000 (GB/s on an H200)."""
    return float(f"{x:.4g}")


def max_abs_err(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """max |got - want|, or None where either holds a NaN or an infinity (JSON has neither)."""
    err = float((got.float() - want.float()).abs().max())
    return err if math.isfinite(err) else None


def check(
    report: Report,
    label: Record,
    pairs: Iterable[tuple[torch.Tensor, torch.Tensor]],
    atol: float = ATOL,
    rtol: float = RTOL,
) -> None:
    """Emit one check record: ok when every element of every `got` is within atol + rtol * |want|
    (a NaN never is); max_abs_err is None when some output is not finite."""
    errors: list[float | None] = []
    ok = True
    for got, want in pairs:
        diff = (got.float() - want.float()).abs()
        ok = ok and bool((diff <= atol + rtol * want.float().abs()).all())
        errors.append(max_abs_err(got, want))
    worst = None if None in errors else max(errors)
    report.emit(
        {"kind": "check", **label, "max_abs_err": worst, "atol": atol, "rtol": rtol, "ok": ok}
    )


def _label(scenario: str, case: str, shape: HeadShape, **fields: Any) -> Record:
    """Fields that name a case in every record about it: scenario, a short case name, the head
    shape, then the case's own sizes."""
    return {
        "scenario": scenario,
        "case": case,
        "shape": shape.name,
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        **fields,
    }


def decode_label(shape: HeadShape, case: DecodeCase) -> Record:
    name = f"{shape.name} b{case.batch} ctx{case.context}"
    return _label("decode", name, shape, batch=case.batch, context=case.context)


def prefill_label(shape: HeadShape, case: PrefillCase) -> Record:
    name = f"{shape.name} {case.num_seqs}x{case.new_tokens} +{case.prefix}"
    return _label(
        "prefill", name, shape,
        num_seqs=case.num_seqs, new_tokens=case.new_tokens, prefix=case.prefix,
    )  # fmt: skip


def cache_label(shape: HeadShape, num_tokens: int) -> Record:
    return _label("cache", f"{shape.name} {num_tokens} tokens", shape, num_tokens=num_tokens)


def _speed_fields(t: float, base_t: float, target: float | None) -> Record:
    """ratio = base_t / t, i.e. our throughput over the baseline's."""
    ratio = base_t / t
    return {
        "ratio": _sig(ratio),
        "target": target,
        "ok": None if target is None else ratio >= target,
    }


def _checked_attention(
    report: Report, setup: Setup, b: PagedBatch, scale: float, label: Record
) -> tuple[Callable[[], object], torch.Tensor]:
    """The kernel's paged attention over `b` as a call that writes `out`, for timing; run once
    first and checked against the reference under `label`."""
    out = torch.empty_like(b.q)

    def call() -> object:
        return setup.kernels.paged_attention(*b.paged_args(), scale, out=out)

    call()
    check(report, label, [(out, reference.paged_attention(*b.paged_args(), scale))])
    return call, out


def run_decode(
    report: Report,
    setup: Setup,
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
        check(report, label | {"case": case_name, "sliding_window": window}, [(got, want)])
        del got, want

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(b.q_sdpa, b.k, b.v, scale=scale, enable_gqa=True)

    sdpa_err = max_abs_err(sdpa().view(b.q.shape), out)
    t, t_sdpa = time_us(call, device, setup.cuda_graph), time_us(sdpa, device, setup.cuda_graph)
    kv_bytes = b.k.numel() * b.k.element_size() * 2
    report.emit(
        {"kind": "decode", **label, "kv_dtype": _dtype_name(setup.dtype), "kv_bytes": kv_bytes}
        | {"time_us": round(t, 2), "gbps": _sig(kv_bytes / t / 1e3)}
        | {"sdpa_time_us": round(t_sdpa, 2), "sdpa_gbps": _sig(kv_bytes / t_sdpa / 1e3)}
        | {"sdpa_max_abs_err": sdpa_err}
        | _speed_fields(t, t_sdpa, case.target)
    )
    if fp8:
        run_decode_fp8(report, setup, b, shape, label, t, out)


def run_decode_fp8(
    report: Report,
    setup: Setup,
    b: PagedBatch,
    shape: HeadShape,
    label: Record,
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
    check(report, fp8_label | {"sliding_window": None}, [(out, want())])
    quantization_err = max_abs_err(out, base_out)
    replay = _graph_replay(call) if setup.cuda_graph else call
    # Powers of two, so undoing them restores the calibrated scales exactly.
    k_scale.mul_(0.5)
    v_scale.mul_(2.0)
    out.fill_(float("nan"))
    replay()
    rescaled = fp8_label | {"case": f"{fp8_label['case']} rescaled", "sliding_window": None}
    check(report, rescaled | {"cuda_graph": setup.cuda_graph}, [(out, want())])
    k_scale.mul_(2.0)
    v_scale.mul_(0.5)
    del replay

    t = time_us(call, device, setup.cuda_graph)
    kv_bytes = b.k.numel() * k_cache.element_size() * 2  # one byte per element, K and V
    report.emit(
        {"kind": "decode", **fp8_label, "kv_bytes": kv_bytes}
        | {"time_us": round(t, 2), "gbps": _sig(kv_bytes / t / 1e3)}
        | {"base_kv_dtype": _dtype_name(setup.dtype), "base_time_us": round(base_t, 2)}
        | {"base_gbps": _sig(b.k.numel() * b.k.element_size() * 2 / base_t / 1e3)}
        | {"time_vs_base": _sig(t / base_t), "base_max_abs_err": quantization_err}
        | _speed_fields(t, base_t, None)
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


def run_prefill(report: Report, setup: Setup, shape: HeadShape, case: PrefillCase) -> None:
    """Check, then time, a step of `num_seqs` prompts of `new_tokens` on `prefix` cached tokens."""
    n, prefix = case.new_tokens, case.prefix
    label = prefill_label(shape, case)
    device = setup.device
    b = build_batch(setup, shape, case.num_seqs, prefix + n, n, seed=n + prefix)
    scale = shape.head_dim**-0.5
    call, out = _checked_attention(report, setup, b, scale, label)

    sdpa, mask_name, sdpa_out = causal_sdpa(b, scale, prefix)
    sdpa_err = max_abs_err(sdpa_out.transpose(1, 2).reshape(b.q.shape), out)
    del sdpa_out
    t, t_sdpa = time_us(call, device, setup.cuda_graph), time_us(sdpa, device, setup.cuda_graph)
    flops = 4 * shape.head_dim * shape.num_heads * visible_pairs(n, prefix) * case.num_seqs
    report.emit(
        {"kind": "prefill", **label, "flops": flops}
        | {"time_us": round(t, 2), "tflops": _sig(flops / t / 1e6)}
        | {"sdpa_time_us": round(t_sdpa, 2), "sdpa_tflops": _sig(flops / t_sdpa / 1e6)}
        | {"sdpa_mask": mask_name, "sdpa_max_abs_err": sdpa_err}
        | _speed_fields(t, t_sdpa, case.target)
    )


def run_cache(report: Report, setup: Setup, shape: HeadShape, num_tokens: int) -> None:
    """Check (exact), then time, writing `num_tokens` tokens' K/V to a random permutation of the
    cache's slots."""
    label = cache_label(shape, num_tokens)
    kernels, device, dtype = setup.kernels, setup.device, setup.dtype
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    size = (num_tokens, shape.num_kv_heads, shape.head_dim)
    key = torch.randn(size, generator=gen, device=device, dtype=dtype)
    value = torch.randn(size, generator=gen, device=device, dtype=dtype)
    num_blocks = math.ceil(num_tokens / BLOCK_SIZE)
    num_slots = num_blocks * BLOCK_SIZE
    slot_mapping = torch.randperm(num_slots, generator=gen, device=device)[:num_tokens]
    cache_shape = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    caches = [torch.zeros(cache_shape, device=device, dtype=dtype) for _ in range(4)]

    def call() -> None:
        kernels.reshape_and_cache(key, value, caches[0], caches[1], slot_mapping)

    def ref() -> None:
        reference.reshape_and_cache(key, value, caches[2], caches[3], slot_mapping)

    call()
    ref()
    check(report, label, [(caches[0], caches[2]), (caches[1], caches[3])], atol=0.0, rtol=0.0)
    t, t_ref = time_us(call, device), time_us(ref, device)
    written = 2 * key.numel() * key.element_size()
    report.emit(
        {"kind": "cache", **label, "bytes_written": written}
        | {"time_us": round(t, 2), "gbps": _sig(written / t / 1e3)}
        | {"ref_time_us": round(t_ref, 2), "ref_gbps": _sig(written / t_ref / 1e3)}
        | _speed_fields(t, t_ref, None)
    )


def copy_label(shape: HeadShape, num_layers: int, pool_blocks: int, num_copies: int) -> Record:
    return _label(
        "copy", f"{shape.name} {num_layers} layers copy{num_copies}", shape,
        num_layers=num_layers, num_caches=2 * num_layers, num_blocks=pool_blocks,
        num_copies=num_copies,
    )  # fmt: skip


def run_copy(
    report: Report, setup: Setup, shape: HeadShape, num_layers: int, pool_blocks: int, n: int
) -> None:
    """Check (exact, every cache), then time, copying `n` random blocks of the pool to `n` other
    random blocks in each of the layers' K and V caches."""
    label = copy_label(shape, num_layers, pool_blocks, n)
    kernels, device, dtype = setup.kernels, setup.device, setup.dtype
    gen = torch.Generator(device=device).manual_seed(n)
    blocks = torch.randperm(pool_blocks, generator=gen, device=device)
    src, dst = blocks[:n], blocks[n : 2 * n]
    cache_shape = (pool_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
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
    check(report, label, zip(caches, ref_caches, strict=True), atol=0.0, rtol=0.0)
    t, t_ref = time_us(call, device), time_us(ref, device)
    block_bytes = caches[0][0].numel() * caches[0].element_size()
    moved = 2 * n * len(caches) * block_bytes  # each block read once, written once
    report.emit(
        {"kind": "copy", **label, "block_bytes": block_bytes, "bytes": moved}
        | {"time_us": round(t, 2), "gbps": _sig(moved / t / 1e3)}
        | {"ref_time_us": round(t_ref, 2), "ref_gbps": _sig(moved / t_ref / 1e3)}
        | _speed_fields(t, t_ref, None)
    )


def fused_label(layer: LayerShape, op: str, num_tokens: int) -> Record:
    """Fields that name a fused-op case in every record about it."""
    return _label(
        "fused", f"{op} n{num_tokens}", layer.heads,
        op=op, num_tokens=num_tokens, hidden_size=layer.hidden_size,
        intermediate_size=layer.intermediate_size,
    )  # fmt: skip


@dataclass
class FusedCase:
    """One fused op three ways, each a call that returns the tensors the op produces: the kernel
    under test, the torch reference and the unfused torch code the model ran before the fused
    ops. Each call starts from inputs of its own, so the in-place updates of one do not feed
    another."""

    bytes_moved: int  # inputs read once + outputs written once
    call: Callable[[], tuple[torch.Tensor, ...]]
    ref: Callable[[], tuple[torch.Tensor, ...]]
    model: Callable[[], tuple[torch.Tensor, ...]]


def rope_tables(
    head_dim: int, max_positions: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """cos and sin [max_positions, head_dim] float32 in the "rotate half" layout of
    engine/models/rotary.py (plain RoPE; scaling only changes the values)."""
    exponents = torch.arange(0, head_dim, 2, device=device).float() / head_dim
    freqs = torch.arange(max_positions, device=device).float()[:, None] / ROPE_THETA**exponents
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def build_fused_case(setup: Setup, layer: LayerShape, op: str, num_tokens: int) -> FusedCase:
    fused, device, dtype = setup.fused_kernels, setup.device, setup.dtype
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    size = torch.finfo(dtype).bits // 8

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    n, hidden, eps = num_tokens, layer.hidden_size, 1e-5
    if op in ("rms_norm", "fused_add_rms_norm"):
        x, weight = randn(n, hidden), randn(hidden)
        if op == "rms_norm":
            return FusedCase(
                (2 * n * hidden + hidden) * size,
                lambda: (fused.rms_norm(x, weight, eps),),
                lambda: (reference.rms_norm(x, weight, eps),),
                lambda: (reference.rms_norm(x, weight, eps),),  # the model's RMSNorm math
            )
        residuals = [randn(n, hidden)]
        residuals += [residuals[0].clone() for _ in range(2)]

        def model_add_norm() -> tuple[torch.Tensor, ...]:
            # DecoderLayer: x = residual + sublayer output (a new tensor), then the next norm.
            total = residuals[2] + x
            return reference.rms_norm(total, weight, eps), total

        return FusedCase(
            (4 * n * hidden + hidden) * size,
            lambda: fused.fused_add_rms_norm(x, residuals[0], weight, eps),
            lambda: reference.fused_add_rms_norm(x, residuals[1], weight, eps),
            model_add_norm,
        )
    if op == "silu_and_mul":
        gate_up = randn(n, 2 * layer.intermediate_size)
        return FusedCase(
            3 * n * layer.intermediate_size * size,
            lambda: (fused.silu_and_mul(gate_up),),
            lambda: (reference.silu_and_mul(gate_up),),
            lambda: (reference.silu_and_mul(gate_up),),  # the model's MLP math
        )
    heads = layer.heads
    hq, hkv, d = heads.num_heads, heads.num_kv_heads, heads.head_dim
    qkv = randn(n, (hq + 2 * hkv) * d)
    positions = torch.randint(0, layer.max_positions, (n,), generator=gen, device=device)
    cos_table, sin_table = rope_tables(d, layer.max_positions, device)
    num_blocks = math.ceil(n / BLOCK_SIZE)
    slot_mapping = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device=device)[:n]
    cache_shape = (num_blocks, BLOCK_SIZE, hkv, d)
    caches = [torch.zeros(cache_shape, device=device, dtype=dtype) for _ in range(6)]
    # The model looks cos/sin up once per step for all its layers: not part of a layer's cost.
    cos = cos_table[positions].to(dtype).unsqueeze(1)
    sin = sin_table[positions].to(dtype).unsqueeze(1)

    def rotary(ops: ModuleType, k_cache: torch.Tensor, v_cache: torch.Tensor):
        q = ops.rotary_and_cache(
            qkv, positions, cos_table, sin_table, k_cache, v_cache, slot_mapping, hq, hkv, d
        )
        return q, k_cache, v_cache

    def model() -> tuple[torch.Tensor, ...]:
        # engine/models/model.py Attention.forward up to attention, with engine/models/rotary.py
        # apply_rotary.
        qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
        rotated = torch.cat((-qk[..., d // 2 :], qk[..., : d // 2]), dim=-1)
        q, k = rotated.mul_(sin).addcmul_(qk, cos).split([hq, hkv], dim=1)
        v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
        setup.kernels.reshape_and_cache(k, v, caches[4], caches[5], slot_mapping)
        return q, caches[4], caches[5]

    return FusedCase(
        n * (2 * (hq + 2 * hkv) * d * size + 2 * d * 4 + 2 * 8),  # + cos/sin rows, indices
        lambda: rotary(fused, caches[0], caches[1]),
        lambda: rotary(reference, caches[2], caches[3]),
        model,
    )


def run_fused(report: Report, setup: Setup, layer: LayerShape, op: str, num_tokens: int) -> None:
    """Check (to FUSED_RTOL), then time, one fused op against its reference and the model's
    unfused code."""
    label = fused_label(layer, op, num_tokens)
    device = setup.device
    case = build_fused_case(setup, layer, op, num_tokens)
    got, want, model_out = case.call(), case.ref(), case.model()
    rtol = FUSED_RTOL[setup.dtype]
    check(report, label, zip(got, want, strict=True), atol=FUSED_ATOL, rtol=rtol)
    model_errs = [max_abs_err(a, b) for a, b in zip(model_out, want, strict=True)]
    model_err = None if None in model_errs else max(model_errs)
    del got, want, model_out
    t, t_ref, t_model = (time_us(fn, device) for fn in (case.call, case.ref, case.model))
    moved = case.bytes_moved
    report.emit(
        {"kind": "fused", **label, "bytes": moved}
        | {"time_us": round(t, 2), "gbps": _sig(moved / t / 1e3)}
        | {"ref_time_us": round(t_ref, 2), "ref_gbps": _sig(moved / t_ref / 1e3)}
        | {"model_time_us": round(t_model, 2), "model_gbps": _sig(moved / t_model / 1e3)}
        | {"model_ratio": _sig(t_model / t), "model_max_abs_err": model_err}
        | _speed_fields(t, t_ref, None)
    )


def moe_label(shape: MoeShape, num_tokens: int) -> Record:
    """Fields that name a fused-MoE case in every record about it."""
    return {
        "scenario": "moe",
        "case": f"{shape.name} n{num_tokens}",
        "shape": shape.name,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_experts": shape.num_experts,
        "top_k": shape.top_k,
        "num_tokens": num_tokens,
    }


def run_moe(report: Report, setup: Setup, shape: MoeShape, num_tokens: int) -> None:
    """Check (to ATOL / RTOL), then time, the experts of one MoE layer for `num_tokens` tokens
    against the torch reference and the FLOP-equivalent dense layer."""
    label = moe_label(shape, num_tokens)
    moe, device, dtype = setup.moe_kernels, setup.device, setup.dtype
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    h, i, e, k = shape.hidden_size, shape.intermediate_size, shape.num_experts, shape.top_k

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        # Weights at 1 / sqrt(fan_in): activations stay O(1), as in a trained layer.
        return (torch.randn(size, generator=gen, device=device) * scale).to(dtype)

    x = randn(num_tokens, h)
    gate_up, down = randn(e, 2 * i, h, scale=h**-0.5), randn(e, h, i, scale=i**-0.5)
    logits = torch.randn(num_tokens, e, generator=gen, device=device)
    weights, ids = reference.moe_route(logits, k, shape.renormalize)
    dense_gate_up, dense_down = randn(2 * i * k, h, scale=h**-0.5), randn(h, i * k, scale=i**-0.5)

    def call() -> torch.Tensor:
        return moe.fused_moe(x, gate_up, down, weights, ids)

    def ref() -> torch.Tensor:
        return reference.fused_moe(x, gate_up, down, weights, ids)

    def dense() -> torch.Tensor:
        return F.linear(reference.silu_and_mul(F.linear(x, dense_gate_up)), dense_down)

    got, want = call(), ref()
    check(report, label, [(got, want)])
    identical = float((got == want).float().mean())
    del got, want
    t, t_ref, t_dense = (time_us(fn, device) for fn in (call, ref, dense))
    flops = 2 * num_tokens * k * 3 * i * h
    experts_hit = int(ids.unique().numel())
    expert_bytes = experts_hit * 3 * i * h * x.element_size()
    report.emit(
        {"kind": "moe", **label, "flops": flops, "experts_hit": experts_hit}
        | {"expert_bytes": expert_bytes, "ref_identical": round(identical, 4)}
        | {"time_us": round(t, 2), "tflops": _sig(flops / t / 1e6)}
        | {"gbps": _sig(expert_bytes / t / 1e3)}
        | {"ref_time_us": round(t_ref, 2), "ref_tflops": _sig(flops / t_ref / 1e6)}
        | {"dense_time_us": round(t_dense, 2), "dense_tflops": _sig(flops / t_dense / 1e6)}
        | {"dense_ratio": _sig(t_dense / t)}
        | _speed_fields(t, t_ref, None)
    )


def run_sweep(report: Report, setup: Setup, plan: Plan, scenarios: list[str]) -> None:
    """Time each launch configuration in `plan` on its cases, against SDPA in the same run.

    Picks the defaults of `kernels.triton_attention.decode_config` / `extend_config` (and the
    split heuristic) from measurements rather than guesses. One "sweep" record per (case,
    config): its time, the ratio to SDPA, and whether the output matched the reference (a config
    that fails to compile, e.g. for lack of shared memory, is recorded with its error). A sweep
    never fails the run: it only informs.
    """
    kernels = setup.kernels
    if not hasattr(kernels, "decode"):
        raise ValueError(f"--sweep needs kernels.triton_attention, not {kernels.__name__}")
    if "decode" in scenarios:
        for shape, case in plan.sweep_decode:
            b = build_batch(setup, shape, case.batch, case.context, 1, seed=case.context)
            label = decode_label(shape, case)
            runs = [(cfg, None) for cfg in plan.decode_configs]
            if case.batch == 1:  # one long context: how many slices
                runs += [(None, splits) for splits in plan.sweep_splits]
            _sweep_case(report, setup, b, shape, label, runs, decode=True)
            del b
            _free(setup.device)
    if "prefill" in scenarios:
        for shape, case in plan.sweep_prefill:
            n = case.new_tokens
            b = build_batch(setup, shape, case.num_seqs, case.prefix + n, n, seed=n)
            label = prefill_label(shape, case)
            runs = [(cfg, None) for cfg in plan.prefill_configs]
            _sweep_case(report, setup, b, shape, label, runs, decode=False, prefix=case.prefix)
            del b
            _free(setup.device)


def _sweep_case(
    report: Report,
    setup: Setup,
    b: PagedBatch,
    shape: HeadShape,
    label: Record,
    runs: list[tuple[KernelConfig | None, int | None]],
    *,
    decode: bool,
    prefix: int = 0,
) -> None:
    kernels, device = setup.kernels, setup.device
    scale = shape.head_dim**-0.5
    args = (*b.paged_args(), scale, None)
    want = reference.paged_attention(*b.paged_args(), scale)
    if decode:
        max_context = b.block_tables.shape[1] * BLOCK_SIZE
        default_splits = kernels.num_decode_splits(
            b.q.shape[0], shape.num_kv_heads, max_context, device
        )

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(b.q_sdpa, b.k, b.v, scale=scale, enable_gqa=True)
    else:
        sdpa = causal_sdpa(b, scale, prefix)[0]

    t_sdpa = time_us(sdpa, device, setup.cuda_graph)
    out = torch.empty_like(b.q)
    for cfg, splits in runs:
        record: Record = {"kind": "sweep", **label, "sdpa_time_us": round(t_sdpa, 2)}
        if decode:
            splits = splits or default_splits
            record |= {"num_splits": splits, "default_splits": default_splits}
            cfg = cfg or kernels.decode_config(shape.head_dim)

            def call(cfg=cfg, splits=splits) -> None:
                kernels.decode(*args, out, splits, cfg)
        else:
            cfg = cfg or kernels.extend_config(
                shape.head_dim, shape.num_heads // shape.num_kv_heads
            )

            def call(cfg=cfg) -> None:
                kernels.extend(*args, out, cfg)

        record["config"] = dataclasses.asdict(cfg)
        try:
            out.fill_(float("nan"))
            call()
            diff = (out.float() - want.float()).abs()
            record["matches_reference"] = bool((diff <= ATOL + RTOL * want.float().abs()).all())
            t = time_us(call, device, setup.cuda_graph)
            record |= {"time_us": round(t, 2), "ratio": _sig(t_sdpa / t)}
        except Exception as exc:  # e.g. out of shared memory: the config is not an option
            record["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        report.emit(record)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def format_sweep(records: list[Record]) -> str:
    """Best configuration per swept case, and the default's time for comparison."""
    by_case: dict[str, list[Record]] = {}
    for r in records:
        if r["kind"] == "sweep" and "time_us" in r and r["matches_reference"]:
            by_case.setdefault(r["case"], []).append(r)
    lines = []
    for case, rs in by_case.items():
        best = min(rs, key=lambda r: r["time_us"])
        lines.append(
            f"sweep {case:28} best {best['time_us']:9.1f} us (ratio {best['ratio']:.3g}) "
            f"config {best['config']}"
            + (f" splits {best['num_splits']}" if "num_splits" in best else "")
        )
    return "\n".join(lines)


def run_case(report: Report, device: torch.device, label: Record, fn: Callable[[], None]) -> None:
    """Run one case; an exception becomes an error record and the run goes on."""
    try:
        fn()
    except Exception as exc:
        report.emit({"kind": "error", **label, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def environment(setup: Setup, smoke: bool) -> Record:
    """What a reader needs to reproduce the numbers: hardware, versions, commit, settings."""
    device = setup.device
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "kind": "env",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if (status := _git("status", "--porcelain")) is None else bool(status),
        "kernels": setup.kernels.__name__,
        "fused_kernels": None if setup.fused_kernels is None else setup.fused_kernels.__name__,
        "moe_kernels": None if setup.moe_kernels is None else setup.moe_kernels.__name__,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "smoke": smoke,
        "dtype": str(setup.dtype).removeprefix("torch."),
        "block_size": BLOCK_SIZE,
        "timer": (
            "perf_counter median"
            if device.type != "cuda"
            else "do_bench median" + (" of CUDA-graph replays" if setup.cuda_graph else "")
        ),
        "utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _git(*args: str) -> str | None:
    """Output of a git command in the repository, or None where git or the repository is missing
    (the GPU machine gets a copy of the working tree)."""
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parent.parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def format_table(records: list[Record]) -> str:
    """The measurements and a one-line verdict on the checks, for people."""
    row = "{:<8} {:<28} {:>10} {:>15} {:>15} {:>6} {:>6} {}"
    lines = [row.format("kind", "case", "time us", "ours", "baseline", "ratio", "target", "ok")]
    units = {
        "decode": ("gbps", "sdpa_gbps", "GB/s"),
        "prefill": ("tflops", "sdpa_tflops", "TF/s"),
        "cache": ("gbps", "ref_gbps", "GB/s"),
        "copy": ("gbps", "ref_gbps", "GB/s"),
        "fused": ("gbps", "ref_gbps", "GB/s"),
        "moe": ("tflops", "ref_tflops", "TF/s"),
    }
    for r in records:
        if r["kind"] not in units:
            continue
        ours, base, unit = units[r["kind"]]
        if r["kind"] == "decode" and r["kv_dtype"] == FP8_KV:
            base = "base_gbps"  # the kernel over the cache in --dtype
        lines.append(
            row.format(
                r["kind"],
                r["case"],
                f"{r['time_us']:.1f}",
                f"{r[ours]:.4g} {unit}",
                f"{r[base]:.4g} {unit}",
                f"{r['ratio']:.3g}",
                "" if r["target"] is None else f"{r['target']:.2f}",
                {None: "", True: "yes", False: "NO"}[r["ok"]],
            )
        )
        if r["kind"] == "fused":
            baseline = f"{r['model_gbps']:.4g} GB/s"
            model_ratio = f"{r['model_ratio']:.3g}"
            lines.append(row.format("", "  vs model", "", "", baseline, model_ratio, "", ""))
        if r["kind"] == "moe":
            baseline = f"{r['dense_tflops']:.4g} TF/s"
            dense_ratio = f"{r['dense_ratio']:.3g}"
            lines.append(row.format("", "  vs dense", "", "", baseline, dense_ratio, "", ""))
    checks = [r for r in records if r["kind"] == "check"]
    bad = [r["case"] for r in checks if not r["ok"]]
    errors = [r["max_abs_err"] for r in checks]
    worst = "non-finite" if None in errors else f"{max(errors, default=0.0):.4g}"
    lines.append(
        f"checks: {len(checks) - len(bad)}/{len(checks)} ok, max abs err {worst} "
        f"(atol {ATOL}, rtol {RTOL}; cache, copy exact; fused 2 ulps; moe atol, rtol)"
        + (f"; FAILED: {', '.join(bad)}" if bad else "")
    )
    lines += [f"error: {r['case']}: {r['error']}" for r in records if r["kind"] == "error"]
    lines.append(
        "baseline: SDPA on contiguous K/V (decode, prefill); the kernel over the --dtype cache "
        "(decode fp8: GB/s at 1 byte per element); torch reference (cache, copy, fused, "
        'moe; "vs model": the model\'s unfused torch code; "vs dense": the dense layer of the same '
        "active size)"
    )
    return "\n".join(lines)


def parse_scenarios(values: list[str] | None) -> list[str]:
    """`--only` values, repeated and/or comma-separated, in run order; all when none given."""
    if not values:
        return list(SCENARIOS)
    wanted = {v.strip() for value in values for v in value.split(",") if v.strip()}
    unknown = wanted - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    return [s for s in SCENARIOS if s in wanted]


def run_all(report: Report, setup: Setup, plan: Plan, scenarios: list[str]) -> None:
    """The regular run: every case of `plan` in `scenarios`, checked and then timed."""
    device = setup.device
    if "decode" in scenarios:
        for shape in plan.decode_shapes:
            for case in plan.decode_cases:
                checked = (shape, case.batch, case.context) == plan.window_case
                window = plan.sliding_window if checked else None
                fp8 = shape in plan.fp8_decode_shapes
                run = functools.partial(run_decode, report, setup, shape, case, window, fp8)
                run_case(report, device, decode_label(shape, case), run)
    if "prefill" in scenarios:
        for shape in plan.prefill_shapes:
            for case in plan.prefill_cases:
                run = functools.partial(run_prefill, report, setup, shape, case)
                run_case(report, device, prefill_label(shape, case), run)
    if "cache" in scenarios:
        shape, num_tokens = plan.cache_shape, plan.cache_tokens
        run = functools.partial(run_cache, report, setup, shape, num_tokens)
        run_case(report, device, cache_label(shape, num_tokens), run)
    if "copy" in scenarios:
        shape, layers, pool = plan.copy_shape, plan.copy_layers, plan.copy_pool_blocks
        for n in plan.copy_counts:
            run = functools.partial(run_copy, report, setup, shape, layers, pool, n)
            run_case(report, device, copy_label(shape, layers, pool, n), run)
    if "fused" in scenarios:
        for num_tokens in plan.fused_tokens:
            for op in FUSED_OPS:
                run = functools.partial(run_fused, report, setup, plan.fused_layer, op, num_tokens)
                run_case(report, device, fused_label(plan.fused_layer, op, num_tokens), run)
    if "moe" in scenarios:
        for shape in plan.moe_shapes:
            for num_tokens in plan.moe_tokens:
                run = functools.partial(run_moe, report, setup, shape, num_tokens)
                run_case(report, device, moe_label(shape, num_tokens), run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pagedserve.bench.gpu_kernels", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--only", action="append", metavar="|".join(SCENARIOS))
    parser.add_argument("--smoke", "--quick", action="store_true", help="tiny shapes; CPU too")
    parser.add_argument("--out", type=Path, help="also write the JSON lines here")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="default bf16; fp16 for --smoke on CPU, as the Triton interpreter computes a bf16 "
        "tl.dot on raw bit patterns (triton-lang/triton#11584)",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time attention as CUDA-graph replays, without host launch cost (the reference "
        "cache write syncs with the host and stays eager)",
    )
    parser.add_argument(
        "--kernels", default=KERNELS_MODULE, help=f"module under test (default {KERNELS_MODULE})"
    )
    parser.add_argument(
        "--fused-kernels",
        default=FUSED_KERNELS_MODULE,
        help=f"module of the fused ops under test (default {FUSED_KERNELS_MODULE})",
    )
    parser.add_argument(
        "--moe-kernels",
        default=MOE_KERNELS_MODULE,
        help=f"module of the fused MoE under test (default {MOE_KERNELS_MODULE})",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="instead of the regular cases, time the launch configurations of the decode and "
        "prefill kernels (tile, warps, stages, rows; decode splits) on a few cases against SDPA",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        scenarios = parse_scenarios(args.only)
    except ValueError as exc:
        parser.error(f"--only: {exc}")

    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.smoke:
        device = torch.device("cpu")
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("warning: on CPU the Triton kernels need TRITON_INTERPRET=1", file=sys.stderr)
    else:
        print(
            "pagedserve.bench.gpu_kernels: no CUDA device. The benchmark needs a GPU; to check the "
            "code path on CPU run: "
            "TRITON_INTERPRET=1 python -m pagedserve.bench.gpu_kernels --smoke",
            file=sys.stderr,
        )
        return 2
    modules = {"kernels": args.kernels}
    if "fused" in scenarios:
        modules["fused"] = args.fused_kernels
    if "moe" in scenarios:
        modules["moe"] = args.moe_kernels
    try:
        loaded = {role: importlib.import_module(name) for role, name in modules.items()}
    except ImportError as exc:
        print(
            f"pagedserve.bench.gpu_kernels: cannot import {exc.name or modules}: {exc}",
            file=sys.stderr,
        )
        return 2
    dtype_name = args.dtype or ("fp16" if device.type == "cpu" else "bf16")
    graph = args.cuda_graph and device.type == "cuda"
    setup = Setup(
        loaded["kernels"], device, DTYPES[dtype_name], graph, loaded.get("fused"), loaded.get("moe")
    )

    plan = SMOKE if args.smoke else FULL
    sink = args.out.open("w") if args.out else None
    try:
        report = Report(sink)
        report.emit(environment(setup, args.smoke))
        if args.sweep:
            swept = [s for s in scenarios if s in SWEEP_SCENARIOS]
            run = functools.partial(run_sweep, report, setup, plan, swept)
            run_case(report, device, {"scenario": "sweep", "case": "sweep"}, run)
        else:
            run_all(report, setup, plan, scenarios)
    finally:
        if sink is not None:
            sink.close()
    print(format_table(report.records), file=sys.stderr)
    if args.sweep:
        print(format_sweep(report.records), file=sys.stderr)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
