"""Triton paged attention and KV-cache write: the GPU twins of `kernels.reference`.

Same signatures and semantics as the reference; the differences are all about speed:

* No host synchronisation. Which kernel runs, the grid and the number of context splits are
  chosen from tensor shapes only, so the functions can be captured in CUDA graphs. Each program
  finds its sequence by a binary search over `query_start_loc` on the device.
* Decode (`num_tokens == num_seqs`, the steady state of serving) with PAGEDSERVE_BATCH_VARIANT=1
  (below): flash-decoding. A program owns one token, one KV head and one slice of the context;
  the G = num_heads / num_kv_heads query heads that share the KV head are processed together as
  the rows of one `tl.dot`, so each K/V tile is read once per group. When there are too few
  (token, KV head) pairs to fill the GPU, the context is split and the partial results are
  merged by their log-sum-exp in a second kernel.
  (Each program finds its token's sequence and position itself, so the kernel is correct for any
  layout; num_tokens == num_seqs with some sequence at 0 new tokens and another at 2 is fine.)
* Prefill / extend / mixed batches (anything else; by default every step, decodes too): one
  launch over "query tiles". A tile holds BLOCK_Q consecutive new tokens of one sequence times the
  G heads of one KV head, folded into BLOCK_M = BLOCK_Q * G rows (plus padding), and walks the
  sequence's cached prefix and its own new tokens through the block table. In `extend_config`,
  keys that every row of the tile may see are read without a mask; only the tiles on the causal
  diagonal (and, with a sliding window, all of them) are masked.
* Soft-capping (Gemma 2): with `softcap`, each score s = scale * q.k becomes softcap *
  tanh(s / softcap) before the mask and the softmax, as in the reference. The kernels work in the
  log2 domain (exp2 instead of exp), so the natural-log score is capped first and then scaled by
  log2(e). tanh is computed from exp2 (`tanh_f32`, within a few ulps in float32): Triton's own tanh
  differs between versions and between the interpreter and the compiler. A constexpr
  (HAS_SOFTCAP) switches it on, so the uncapped kernels compile to the same code as without it.

One request, one answer (the default): a query's result is a function of its own inputs, position
and keys, bit for bit, whatever else shares the step (`cpu_features.batch_variant` off, as on
CPU). Every step, decode, prefill or mixed, runs the prefill/extend kernel with one launch
configuration per head layout (`invariant_config`: query tiles of 16 rows, 64-key tiles; never
the batch, the SM count or the context): a decode token goes through the very kernel it would
meet inside a prefill chunk. Each query row is reduced over the TILE-aligned key tiles from 0 (or
its window's first tile) to its own position in order, one online-softmax update per tile, then
one division (and the kernel is not specialized on the batch's sizes: one binary for every
step of a model); every tile takes the masked path (`KernelConfig.mask_every_tile`), because the
unmasked prefix ends where the query tile's first row sees, and the two paths may be compiled
with their multiply-adds fused differently. A tile past a row's position or before its window is
an exact no-op for that row (max unchanged, exp2(0) = 1, exp2(-inf) = 0), so the rows that share
its query tile, and how many key tiles they walk, leave its bits alone. No context split, no
atomics. PAGEDSERVE_BATCH_VARIANT=1 restores the faster batch-dependent dispatch above: decode
steps through the split-context decode kernel, whose number of splits comes from the batch size,
the SM count and the context, and other steps through the extend kernel in 128-row tiles with an
unmasked prefix.

Every program reads keys through the block table one token at a time (`block_tables[s, n //
block_size] * block_size + n % block_size`), so tiles need not align with blocks and any block
size works. Keys outside a sequence's context are never loaded (masked loads), so unlike the
reference these kernels do not need unwritten cache slots to be finite.

* fp8 KV caches (`kernels.fp8`): the attention kernels load fp8 K/V tiles (one byte per element)
  and dequantize them in registers, tile * scale rounded to q's dtype, as the reference does
  before its products; the cache writes quantize in registers (`quantize_fp8`). The scales are
  read from memory by every program (the engine calibrates them in place, after CUDA graphs are
  captured). Constexprs switch fp8 on, so kernels for caches in q's dtype compile as before.

Under TRITON_INTERPRET=1 (set before this module is imported) the same kernels run on CPU tensors
with numpy; the tests use that to check them against the reference.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels import cpu_features, validation
from pagedserve.kernels.fp8 import is_fp8
from pagedserve.kernels.validation import (
    check_copy_blocks_args,
    check_paged_attention_args,
    check_reshape_and_cache_args,
)

__all__ = [
    "INTERPRETED",
    "KernelConfig",
    "check_runnable",
    "copy_blocks",
    "decode",
    "decode_config",
    "extend",
    "extend_config",
    "invariant_config",
    "num_decode_splits",
    "paged_attention",
    "reshape_and_cache",
]

LOG2_E = 1 / math.log(2)  # exp(x) = exp2(x * LOG2_E)
# Initial running max: finite, so a row whose first tiles are all masked computes exp2(-inf - m)
# = 0 instead of exp2(-inf - -inf) = NaN.
_NEG_BIG = tl.constexpr(-1.0e30)
_MINUS_TWO_LOG2_E = tl.constexpr(-2 * LOG2_E)  # exp(-2x) = exp2(x * _MINUS_TWO_LOG2_E)
# A context slice shorter than this is not worth a second (merge) kernel.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 32


# ------------------------------------------------------------------------------ KV-cache write


@triton.jit
def quantize_fp8(
    x,
    scale,
    dtype: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXP: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """x / scale in fp8 `dtype`, saturated at +-FP8_MAX and rounded to nearest even: torch's
    (x.float() / scale).clamp(-max, max).to(dtype) bit for bit (see `kernels.fp8`).

    The rounding is done here, in float32 with integer ops, so the final conversion only ever
    sees values the format holds exactly: the result does not depend on the conversion's own
    rounding, which differs between the interpreter (it drops the carry of a round-up into the
    exponent: 7.77 -> 4 in e4m3) and the GPU's cvt. MANTISSA is the format's mantissa bits,
    MIN_EXP the float32 exponent field of its smallest normal; below it the step stays that of
    the smallest normal (the fp8 subnormals). The division is IEEE (div_rn), as torch's. NaN is
    passed to the conversion as it is: NaN on the GPU, a finite value under the interpreter,
    whose conversion ignores NaN."""
    y = x.to(tl.float32)
    if HAS_SCALE:
        y = tl.math.div_rn(y, scale)
    y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))  # NaN compares false
    bits = y.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    significand = (bits & 0x7FFFFF) | 0x800000  # 24 bits with the leading one
    # Bits below the fp8 step at y's binade; 25 or more leave 0 (also for zero and the float32
    # subnormals, whose significand is then wrong but rounds to 0 all the same).
    drop = tl.minimum((23 - MANTISSA) + tl.maximum(MIN_EXP - exp, 0), 25)
    half = (1 << (drop - 1)) - 1
    steps = (significand + half + ((significand >> drop) & 1)) >> drop  # ties to even
    step = ((tl.maximum(exp, MIN_EXP) - MANTISSA) << 23).to(tl.float32, bitcast=True)
    magnitude = steps.to(tl.float32) * step  # exact: a small integer times a power of two
    rounded = tl.where(bits < 0, -magnitude, magnitude)
    return tl.where(y == y, rounded, y).to(dtype)


@triton.jit
def load_kv_scales(k_scale_ptr, v_scale_ptr, HAS_KV_SCALES: tl.constexpr):
    """The fp8 cache's K and V scales, read at every call (1.0 without them)."""
    k_scale = 1.0
    v_scale = 1.0
    if HAS_KV_SCALES:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    return k_scale, v_scale


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_slots,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    k_stride_slot,
    k_stride_h,
    v_stride_slot,
    v_stride_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_KV_SCALES: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,  # 0: the cache is in key's dtype
    FP8_MIN_EXP: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    # Padding tokens (negative slot) are skipped; an out-of-range slot is skipped too rather than
    # written past the cache (the reference raises for it, which needs a host sync).
    if (slot < 0) | (slot >= num_slots):
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + token * key_stride_t + h * key_stride_h + d, mask=mask)
    v = tl.load(value_ptr + token * value_stride_t + h * value_stride_h + d, mask=mask)
    if FP8_MANTISSA > 0:
        k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, HAS_KV_SCALES)
        k = quantize_fp8(
            k, k_scale, k_cache_ptr.dtype.element_ty, HAS_KV_SCALES, FP8_MANTISSA, FP8_MIN_EXP,
            FP8_MAX,
        )  # fmt: skip
        v = quantize_fp8(
            v, v_scale, v_cache_ptr.dtype.element_ty, HAS_KV_SCALES, FP8_MANTISSA, FP8_MIN_EXP,
            FP8_MAX,
        )  # fmt: skip
    tl.store(k_cache_ptr + slot * k_stride_slot + h * k_stride_h + d, k, mask=mask)
    tl.store(v_cache_ptr + slot * v_stride_slot + h * v_stride_h + d, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's key and value into its cache slot (quantized into an fp8 cache); see
    `kernels.reference`.

    Unlike the reference, a slot past the end of the cache is skipped instead of raising: the
    check would need the slots on the host.
    """
    if validation.CHECK_ARGS:
        check_reshape_and_cache_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        check_runnable(key.device)
        _check_inner_contiguous(k_cache=k_cache, v_cache=v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _inner_contiguous(key), _inner_contiguous(value)
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *kv_scale_args(k_cache, k_scale, v_scale),
        k_cache.shape[0] * k_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        **fp8_write_constexprs(k_cache, k_scale, v_scale),
    )


def kv_scale_args(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (k_scale_ptr, v_scale_ptr) kernel arguments: the scales of an fp8 cache, a 1.0 tensor
    in place of a missing one, or the cache itself (never read) where the kernel reads none
    (HAS_KV_SCALES false: no scales, or a cache that is not fp8)."""
    if not _has_kv_scales(k_cache, k_scale, v_scale):
        return k_cache, k_cache
    one = torch.ones(1, dtype=torch.float32, device=k_cache.device)  # only when one is missing
    return (one if k_scale is None else k_scale), (one if v_scale is None else v_scale)


def _has_kv_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> bool:
    return is_fp8(k_cache.dtype) and (k_scale is not None or v_scale is not None)


def fp8_write_constexprs(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> dict[str, object]:
    """The cache writes' fp8 constexprs (see `quantize_fp8`); FP8_MANTISSA = 0 for a cache that
    is not fp8, which compiles the plain copy."""
    if not is_fp8(k_cache.dtype):
        return dict(HAS_KV_SCALES=False, FP8_MANTISSA=0, FP8_MIN_EXP=0, FP8_MAX=0.0)
    info = torch.finfo(k_cache.dtype)
    return dict(
        HAS_KV_SCALES=_has_kv_scales(k_cache, k_scale, v_scale),
        FP8_MANTISSA=round(-math.log2(info.eps)),
        FP8_MIN_EXP=127 + round(math.log2(info.smallest_normal)),
        FP8_MAX=float(info.max),
    )


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs,  # [num_caches] int64: the address of each cache
    src_ptr,
    dst_ptr,
    block_numel,  # elements in one block of one cache
    DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (copy, cache, chunk): BLOCK elements of one block of one cache."""
    copy = tl.program_id(0)
    cache = tl.load(cache_ptrs + tl.program_id(1)).to(tl.pointer_type(DTYPE))
    offsets = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < block_numel
    src = tl.load(src_ptr + copy).to(tl.int64)
    dst = tl.load(dst_ptr + copy).to(tl.int64)
    values = tl.load(cache + src * block_numel + offsets, mask=mask)
    tl.store(cache + dst * block_numel + offsets, values, mask=mask)


_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float8_e4m3fn: tl.float8e4nv,
    torch.float8_e5m2: tl.float8e5,
}


def copy_blocks(caches: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy KV block `src[i]` into block `dst[i]` in every cache, all layers in one launch; see
    `kernels.reference`."""
    if validation.CHECK_ARGS:
        check_copy_blocks_args(caches, src, dst)
        check_runnable(src.device)
    num_copies = src.numel()
    if num_copies == 0:
        return
    first = caches[0]
    addresses = torch.tensor([cache.data_ptr() for cache in caches], dtype=torch.int64)
    block_numel = first[0].numel()
    block = min(4096, triton.next_power_of_2(block_numel))
    _copy_blocks_kernel[(num_copies, len(caches), triton.cdiv(block_numel, block))](
        addresses.to(first.device, non_blocking=True),
        src,
        dst,
        block_numel,
        DTYPE=_TL_DTYPES[first.dtype],
        BLOCK=block,
    )


# ------------------------------------------------------------------------------------- helpers


@triton.jit
def _last_start_at_or_before(query_start_loc_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest s in [0, num_seqs) with query_start_loc[s] // BLOCK_Q + s * (BLOCK_Q > 0) <= target.

    With BLOCK_Q == 0 this is the sequence that owns new token `target` (sequences without new
    tokens share their start with the next one, so the largest index is the owner). With
    BLOCK_Q > 0 it is the sequence that owns query tile `target`, where sequence s's tiles are
    numbered from query_start_loc[s] // BLOCK_Q + s: a strictly increasing start, and enough room
    for ceil(q_len / BLOCK_Q) tiles before the next sequence's.
    """
    lo = 0
    hi = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid)
        if BLOCK_Q > 0:
            start = start // BLOCK_Q + mid
        if start <= target:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _online_softmax_step(s, v, m, row_sum, acc, PRECISION: tl.constexpr):
    """Fold one tile into the running softmax: s = scores * log2(e) [rows, keys] with masked keys
    at -inf, v = the tile's values [keys, D]; m, row_sum = running max and sum of exp2 per row."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, row_sum, acc


@triton.jit
def tanh_f32(x):
    """tanh(x) in float32 from exp2, within about 3 ulps everywhere (with numpy's exp2; the GPU's
    ex2.approx adds a little). With e = exp(-2|x|) and r = 1 / (1 + e), |tanh(x)| is:

        |x| < 0.25          an odd Taylor polynomial: (1 - e) would cancel x's low bits away
        0.25 <= |x| < 0.55  (1 - e) * r
        0.55 <= |x|         1 - 2e * r: the small tail 2e * r is accurate, so the result is
                            rounded about as torch.tanh rounds it (e underflows to 0: +-1)

    The last branch matters for GELU: 1 + tanh(inner) for a negative inner keeps only the tail,
    and torch's F.gelu computes exactly that sum."""
    ax = tl.abs(x)
    e = tl.exp2(ax * _MINUS_TWO_LOG2_E)
    r = 1.0 / (1.0 + e)
    # x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835 - 1382x^11/155925 of the clamped |x| (the next
    # term is < 1e-8 relative at 0.25; the clamp keeps the powers finite).
    a = tl.minimum(ax, 0.25)
    a2 = a * a
    p = a2 * -0.008863235529902197 + 0.021869488536155203
    p = p * a2 - 0.05396825396825397
    p = p * a2 + 0.13333333333333333
    p = p * a2 - 0.3333333333333333
    t = tl.where(ax < 0.25, a + a * a2 * p, tl.where(ax < 0.55, (1.0 - e) * r, 1.0 - (e + e) * r))
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(q, k, qk_scale, softcap_log2, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """A tile's scores in the log2 domain, [rows, keys]: q @ k * qk_scale with qk_scale = scale *
    log2(e); with HAS_SOFTCAP, softcap * tanh(scale * q.k / softcap) * log2(e), from qk_scale =
    scale / softcap and softcap_log2 = softcap * log2(e) (see `_score_scales`)."""
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    if HAS_SOFTCAP:
        s = tanh_f32(s) * softcap_log2
    return s


@triton.jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq,
    bt_stride,
    n,
    valid,
    kv_head,
    k_stride_slot,
    k_stride_h,
    v_stride_slot,
    v_stride_h,
    d,
    d_ok,
    k_scale,
    v_scale,
    dtype: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    FP8_KV: tl.constexpr,
    HAS_KV_SCALES: tl.constexpr,
):
    """K (transposed, [BLOCK_D, TILE]) and V ([TILE, BLOCK_D]) of key positions `n` of sequence
    `seq`, read through its block table. With MASKED, positions not `valid` are neither looked up
    nor loaded (they read as 0); without it every position must lie in the context. With FP8_KV
    the fp8 tiles are dequantized to `dtype` (q's): tile * scale, rounded as the reference
    rounds."""
    if MASKED:
        block = tl.load(block_tables_ptr + seq * bt_stride + n // BLOCK_SIZE, mask=valid, other=0)
        k_mask = valid[None, :] & d_ok[:, None]
        v_mask = valid[:, None] & d_ok[None, :]
    else:
        block = tl.load(block_tables_ptr + seq * bt_stride + n // BLOCK_SIZE)
        k_mask = d_ok[:, None]
        v_mask = d_ok[None, :]
    slots = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
    k = tl.load(
        k_cache_ptr + slots[None, :] * k_stride_slot + kv_head * k_stride_h + d[:, None],
        mask=k_mask,
        other=0.0,
    )
    v = tl.load(
        v_cache_ptr + slots[:, None] * v_stride_slot + kv_head * v_stride_h + d[None, :],
        mask=v_mask,
        other=0.0,
    )
    if FP8_KV:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        if HAS_KV_SCALES:
            k = k * k_scale
            v = v * v_scale
        k = k.to(dtype)
        v = v.to(dtype)
    return k, v


# -------------------------------------------------------------------------------------- decode


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_seqs,
    qk_scale,
    softcap_log2,
    sliding_window,
    q_stride_t,
    q_stride_h,
    k_stride_slot,
    k_stride_h,
    v_stride_slot,
    v_stride_h,
    bt_stride,
    out_stride_t,
    out_stride_h,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8_KV: tl.constexpr,
    HAS_KV_SCALES: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # In a pure decode step token i is sequence i: two loads confirm it and skip the search.
    # (Masked: with more tokens than sequences, token + 1 may lie past query_start_loc's end.)
    own = token < num_seqs
    start = tl.load(query_start_loc_ptr + token, mask=own, other=-1)
    end = tl.load(query_start_loc_ptr + token + 1, mask=own, other=-1)
    if (start == token) & (end == token + 1):
        seq = token
    else:
        seq = _last_start_at_or_before(query_start_loc_ptr, token, num_seqs, 0)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    pos = tl.load(seq_lens_ptr + seq) - q_len + (token - q_start)  # this token's position
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(pos - sliding_window + 1, 0)
    kv_end = pos + 1
    # This program's slice of the context, in whole tiles counted from kv_lo's tile.
    tile_lo = kv_lo // TILE * TILE
    num_tiles = tl.cdiv(kv_end - tile_lo, TILE)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    row_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + token * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [GROUP_PAD, BLOCK_D]

    k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, HAS_KV_SCALES)
    m = tl.full([GROUP_PAD], _NEG_BIG, tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for i in range(first_tile, last_tile):
        n = tile_lo + i * TILE + tl.arange(0, TILE)
        valid = (n >= kv_lo) & (n < kv_end)
        k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, bt_stride, n, valid, kv_head,
            k_stride_slot, k_stride_h, v_stride_slot, v_stride_h, d, d_ok, k_scale, v_scale,
            q_ptr.dtype.element_ty, BLOCK_SIZE, True, FP8_KV, HAS_KV_SCALES,
        )  # fmt: skip
        s = _scores(q, k, qk_scale, softcap_log2, HAS_SOFTCAP, PRECISION)  # [GROUP_PAD, TILE]
        s = tl.where(valid[None, :], s, float("-inf"))
        m, row_sum, acc = _online_softmax_step(s, v, m, row_sum, acc, PRECISION)

    if NUM_SPLITS == 1:
        out = acc / row_sum[:, None]
        tl.store(
            out_ptr + token * out_stride_t + heads[:, None] * out_stride_h + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # An empty slice (past the end of a short context) has row_sum = 0: weight exp2(-inf) = 0.
        safe_sum = tl.where(row_sum > 0, row_sum, 1.0)
        lse = tl.where(row_sum > 0, m + tl.log2(safe_sum), float("-inf"))
        part = (token * NUM_HEADS + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(
            part_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
            acc / safe_sum[:, None],
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    out_stride_t,
    out_stride_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """out = sum_i w_i * o_i / sum_i w_i with w_i = 2^(lse_i - max lse), per (token, head)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    part = (token * NUM_HEADS + head) * NUM_SPLITS + sp
    lse = tl.load(part_lse_ptr + part, mask=sp < NUM_SPLITS, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=(sp < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + token * out_stride_t + head * out_stride_h + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


# ------------------------------------------------------------------------------ prefill/extend


# The batch's own sizes are not specialized on (Triton compiles a variant for an int argument
# equal to 1 or divisible by 16): a decode alone and in a batch of 64 run the same binary.
@triton.jit(do_not_specialize=["num_seqs", "bt_stride"])
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_seqs,
    qk_scale,
    softcap_log2,
    sliding_window,
    q_stride_t,
    q_stride_h,
    k_stride_slot,
    k_stride_h,
    v_stride_slot,
    v_stride_h,
    bt_stride,
    out_stride_t,
    out_stride_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8_KV: tl.constexpr,
    HAS_KV_SCALES: tl.constexpr,
    MASK_EVERY_TILE: tl.constexpr,
):
    """Row r of a tile is new token first + r // GROUP, query head kv_head * GROUP + r % GROUP.

    For a sequence with 6 cached tokens and 5 new ones, BLOCK_Q = 2 and GROUP = 2 (BLOCK_M = 4):

        tile 0: new tokens 0-1 (positions 6-7)  keys 0..5 unmasked, keys 6..7 on the diagonal
        tile 1: new tokens 2-3 (positions 8-9)  keys 0..7 unmasked, keys 8..9 on the diagonal
        tile 2: new token 4 (position 10)       rows 2-3 are padding and repeat token 4
    """
    # Highest tiles first: a sequence's later tiles see more keys, and starting the longest
    # programs first keeps SMs from idling at the end of a causal prefill.
    tile_id = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _last_start_at_or_before(query_start_loc_ptr, tile_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (tile_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first new token of the tile
    if first >= q_len:
        return  # the grid is an upper bound on the number of tiles
    num_cached = tl.load(seq_lens_ptr + seq) - q_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok = first + r // GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
    tok = tl.minimum(tok, q_len - 1)  # padding rows repeat a real token: no row is fully masked
    heads = kv_head * GROUP + r % GROUP
    pos = num_cached + tok  # [BLOCK_M]
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
        mask=d_ok[None, :],
        other=0.0,
    )

    first_pos = num_cached + first
    kv_end = num_cached + tl.minimum(first + BLOCK_Q, q_len)  # last position of the tile + 1
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(first_pos - sliding_window + 1, 0)
    tile_lo = kv_lo // TILE * TILE
    if HAS_WINDOW or MASK_EVERY_TILE:
        unmasked_end = tile_lo  # every tile masked
    else:
        unmasked_end = (first_pos + 1) // TILE * TILE  # keys <= first_pos: seen by every row

    k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, HAS_KV_SCALES)
    m = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(tile_lo, unmasked_end, TILE):
        n = start + tl.arange(0, TILE)
        k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, bt_stride, n, n >= 0, kv_head,
            k_stride_slot, k_stride_h, v_stride_slot, v_stride_h, d, d_ok, k_scale, v_scale,
            q_ptr.dtype.element_ty, BLOCK_SIZE, False, FP8_KV, HAS_KV_SCALES,
        )  # fmt: skip
        s = _scores(q, k, qk_scale, softcap_log2, HAS_SOFTCAP, PRECISION)
        m, row_sum, acc = _online_softmax_step(s, v, m, row_sum, acc, PRECISION)
    for start in range(unmasked_end, kv_end, TILE):
        n = start + tl.arange(0, TILE)
        in_range = (n >= kv_lo) & (n < kv_end)
        k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, bt_stride, n, in_range, kv_head,
            k_stride_slot, k_stride_h, v_stride_slot, v_stride_h, d, d_ok, k_scale, v_scale,
            q_ptr.dtype.element_ty, BLOCK_SIZE, True, FP8_KV, HAS_KV_SCALES,
        )  # fmt: skip
        s = _scores(q, k, qk_scale, softcap_log2, HAS_SOFTCAP, PRECISION)
        visible = in_range[None, :] & (n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible &= n[None, :] > pos[:, None] - sliding_window
        s = tl.where(visible, s, float("-inf"))
        m, row_sum, acc = _online_softmax_step(s, v, m, row_sum, acc, PRECISION)

    out = acc / row_sum[:, None]
    tl.store(
        out_ptr
        + (q_start + tok)[:, None] * out_stride_t
        + heads[:, None] * out_stride_h
        + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


# ------------------------------------------------------------------------------------ wrappers


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged K/V (fp8 or in q's dtype);
    see `kernels.reference`.

    By default every step runs the extend kernel in `invariant_config`, so that a query's result
    does not depend on the batch (the module's docstring). With PAGEDSERVE_BATCH_VARIANT=1
    (`cpu_features.batch_variant`) a step with one new token per sequence (num_tokens ==
    num_seqs) runs the split-context decode kernel, anything else the extend kernel in
    `extend_config`. Both are correct for any layout (the decode kernel handles each token on its
    own), so the choice needs only shapes. Value checks that need the host (query_start_loc
    monotone, seq_len >= q_len, block-table capacity) are the reference's; here, as in the model
    runner, the caller guarantees them.
    """
    if validation.CHECK_ARGS:
        check_paged_attention_args(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
            out, softcap, k_scale, v_scale,
        )  # fmt: skip
        check_runnable(q.device)
        _check_inner_contiguous(k_cache=k_cache, v_cache=v_cache)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_tokens, num_seqs = q.shape[0], block_tables.shape[0]
    if num_tokens == 0:
        return out
    if num_seqs == 0:
        raise ValueError(f"q has {num_tokens} tokens but there are no sequences")
    q = _inner_contiguous(q)
    if not cpu_features.batch_variant():
        config = invariant_config(q.shape[2], q.shape[1] // k_cache.shape[2])
        extend(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
            out, config, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    elif num_tokens == num_seqs:
        num_splits = num_decode_splits(
            num_tokens, k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1], q.device
        )
        decode(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            sliding_window,
            out,
            num_splits,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    else:
        extend(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
            out, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    return out


def num_decode_splits(
    num_tokens: int, num_kv_heads: int, max_context: int, device: torch.device
) -> int:
    """How many slices to cut each decode context into, from shapes only.

    Enough (token, KV head, slice) programs to give every SM two, but no slice shorter than
    _MIN_KEYS_PER_SPLIT keys of the longest possible context (`max_context`, the block-table
    width times the block size): merging costs a second kernel. A power of two, so at most a
    handful of kernel variants are compiled.
    """
    programs = num_tokens * num_kv_heads
    wanted = triton.cdiv(2 * _num_sms(device), programs)
    splits = min(wanted, max_context // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS)
    if splits <= 1:
        return 1
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    num_splits: int,
    config: KernelConfig | None = None,
    *,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The decode kernel with a given number of context slices (tests force several) and
    optionally a launch configuration (the benchmark sweeps them); `softcap`, `k_scale` and
    `v_scale` as in `paged_attention`.

    Correct for any batch layout (each program handles one token), but it reads each token's
    keys on its own, so `paged_attention` uses it only when every sequence has one new token."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    cfg = config or decode_config(head_dim)
    if num_splits > 1:
        part_out = torch.empty(
            num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(num_tokens, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        part_out,
        part_lse,
        *kv_scale_args(k_cache, k_scale, v_scale),
        block_tables.shape[0],
        *_score_scales(scale, softcap),
        sliding_window or 0,
        *_strides(q, k_cache, v_cache, block_tables, out),
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_SIZE=block_size,
        TILE=cfg.tile,
        NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        PRECISION=_precision(q.dtype),
        FP8_KV=is_fp8(k_cache.dtype),
        HAS_KV_SCALES=_has_kv_scales(k_cache, k_scale, v_scale),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=_block_d(head_dim),
            NUM_SPLITS=num_splits,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4,
        )


def extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    config: KernelConfig | None = None,
    *,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The prefill/extend kernel over any batch (tests also run decode steps through it), with
    optionally a launch configuration (the benchmark sweeps them); `softcap`, `k_scale` and
    `v_scale` as in `paged_attention`."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    cfg = config or extend_config(head_dim, group)
    block_q = cfg.block_m // group
    # Sequence s's tiles start at query_start_loc[s] // block_q + s; this bounds the last one.
    num_tiles = num_tokens // block_q + num_seqs
    _extend_kernel[(num_tiles, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        *kv_scale_args(k_cache, k_scale, v_scale),
        num_seqs,
        *_score_scales(scale, softcap),
        sliding_window or 0,
        *_strides(q, k_cache, v_cache, block_tables, out),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=block_q,
        TILE=cfg.tile,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        PRECISION=_precision(q.dtype),
        FP8_KV=is_fp8(k_cache.dtype),
        HAS_KV_SCALES=_has_kv_scales(k_cache, k_scale, v_scale),
        MASK_EVERY_TILE=cfg.mask_every_tile,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


# ------------------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one kernel: keys per K/V tile, warps, software-pipeline stages, and
    for the extend kernel the query rows per tile (query tokens x grouped heads) and whether every
    key tile takes the masked path (`invariant_config`)."""

    tile: int
    num_warps: int
    num_stages: int
    block_m: int = 0
    mask_every_tile: bool = False


def decode_config(head_dim: int) -> KernelConfig:
    # A K tile of 16 KiB in bf16 either way; decode is bound by reading K/V.
    return KernelConfig(tile=64 if head_dim > 64 else 128, num_warps=4, num_stages=3)


def extend_config(head_dim: int, group: int) -> KernelConfig:
    # 128 query rows (128 // group tokens) against 64-key tiles, as in FlashAttention-2.
    block_m = 128 if group <= 128 else triton.next_power_of_2(group)
    return KernelConfig(tile=64, num_warps=8 if head_dim > 64 else 4, num_stages=2, block_m=block_m)


def invariant_config(head_dim: int, group: int) -> KernelConfig:
    """The extend kernel's launch for every step by default (see the module's docstring): from
    the head layout alone, never from the batch. 16 query rows per tile (block_m // group
    tokens; more for a group above 16), as in vLLM's unified kernel, so that a decode token,
    alone in its tile, computes few padding rows; 64-key tiles, every one masked. The cost against
    the batch-variant kernels is what `benchmarks.gpu_kernels --invariance` measures."""
    block_m = max(16, triton.next_power_of_2(group))
    return KernelConfig(tile=64, num_warps=4, num_stages=2, block_m=block_m, mask_every_tile=True)


def _strides(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
) -> tuple[int, ...]:
    """The attention kernels' stride arguments, in their order. A cache slot (block * block_size
    + offset) steps by stride(1): the validation checks stride(0) == block_size * stride(1)."""
    return (
        q.stride(0),
        q.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
    )


def _score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """The kernels' (qk_scale, softcap_log2) arguments (see `_scores`): (scale * log2(e), unused)
    without a cap, (scale / softcap, softcap * log2(e)) with one."""
    if softcap is None:
        return float(scale) * LOG2_E, 0.0
    return float(scale) / float(softcap), float(softcap) * LOG2_E


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dim >= 16


def _precision(dtype: torch.dtype) -> str:
    # float32 stays float32 (the engine's fp32 path is compared token for token with
    # transformers); TF32 would round q and K to 10 mantissa bits.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _num_sms_of(device_type: str, index: int | None) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index or 0).multi_processor_count
    return 4  # the interpreter on CPU: small, so tests see contexts split


def _num_sms(device: torch.device) -> int:
    return _num_sms_of(device.type, device.index)


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_inner_contiguous(**caches: torch.Tensor) -> None:
    for name, cache in caches.items():
        if cache.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous along head_dim, got strides {cache.stride()}"
            )


INTERPRETED: bool = not isinstance(_decode_kernel, triton.runtime.JITFunction)


def check_runnable(device: torch.device) -> None:
    """Raise ValueError unless the kernels can run on `device` (CUDA, or anything under the
    interpreter)."""
    if device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"the Triton attention kernels need CUDA tensors, got tensors on {device}. Use the "
            "torch backend (PAGEDSERVE_ATTENTION_BACKEND=torch), or set TRITON_INTERPRET=1 "
            "before pagedserve is imported to run the kernels on CPU with Triton's interpreter."
        )
