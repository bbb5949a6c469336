"""Fused Triton kernels for the Llama decoder's non-attention ops: the GPU twins of the
`kernels.reference` functions of the same names and signatures.

    rms_norm            weight * normalise(x), or Gemma's (1 + weight) * normalise(x)
    fused_add_rms_norm  residual += x (in place), then rms_norm(residual)
    silu_and_mul        silu(gate) * up, from the stacked gate/up projection
    gelu_tanh_and_mul   gelu_tanh(gate) * up (Gemma's GeGLU), from the same kernel
    rotary_and_cache    RoPE on q and k straight from the stacked qkv projection; rotated k and
                        raw v written to the paged KV cache (quantized into an fp8 cache, with
                        `triton_attention.quantize_fp8`), rotated q returned

Each op reads its inputs once and writes its outputs once, where the torch reference makes
float32 copies, rotated copies and temporaries. The arithmetic is float32 and results are
rounded to the input dtype exactly where the reference rounds (the normalised x before the
weight, or with Gemma's unit offset only the product; the activation before the product with up;
rot(x) * sin before the sum), so float32 outputs agree with the
reference to a few ulps and float16/bfloat16 outputs to within two ulps (an intermediate that
lands one ulp off, e.g. from a differently rounded exp, scaled by the product after it); most
are bit-identical.

No host synchronisation: grids and constexprs come from shapes only, so the ops can be captured
in CUDA graphs. The value checks that would need the host are not made; instead no program reads
or writes outside its tensors: a position outside the cos/sin tables is clamped into them (the
reference raises an IndexError), and a slot past the end of the cache is skipped like a padding
slot (the reference raises a ValueError), as in `triton_attention.reshape_and_cache`.

Under TRITON_INTERPRET=1 (set before this module is imported) the same kernels run on CPU tensors
with numpy; tests/kernels/test_fused.py uses that to check them against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import triton_attention, validation
from pagedserve.kernels.triton_attention import (
    fp8_write_constexprs,
    kv_scale_args,
    load_kv_scales,
    quantize_fp8,
    tanh_f32,
)
from pagedserve.kernels.validation import (
    check_fused_add_rms_norm_args,
    check_rms_norm_args,
    check_rotary_and_cache_args,
    check_silu_and_mul_args,
)

__all__ = [
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "rms_norm",
    "rotary_and_cache",
    "silu_and_mul",
]

# Columns per silu_and_mul / gelu_tanh_and_mul program: rows are split across programs, so a
# decode step (a few rows of 8-28k columns) still fills the GPU.
_SILU_BLOCK = 1024
# GELU's tanh approximation: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), torch's constants.
_GELU_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_GELU_KAPPA = tl.constexpr(0.044715)


# ------------------------------------------------------------------------------------ RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    eps,
    x_stride_t,
    residual_stride_t,
    out_stride_t,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    """One row: out = weight * (h * rsqrt(mean(h^2) + eps)) with h = x, or with ADD_RESIDUAL
    h = x + residual, also stored to residual. Rounded as the reference rounds: h to the dtype,
    the normalised row to the dtype, then the product with the weight (a float16/bfloat16
    product is exact in float32, so one rounding of it equals torch's). With UNIT_OFFSET
    (Gemma), out = (1 + weight) * normalised row, all in float32 and rounded once."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + token * x_stride_t + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        residual_row = residual_ptr + token * residual_stride_t
        residual = tl.load(residual_row + cols, mask=mask, other=0.0).to(tl.float32)
        # Rounded to the dtype once, like torch's x + residual: float32 has the 2p + 2 bits that
        # make rounding a float16/bfloat16 sum first to float32 harmless.
        total = (h + residual).to(dtype)
        tl.store(residual_row + cols, total, mask=mask)
        h = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, 0) / HIDDEN + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        out = (h * inv_rms) * (1.0 + weight)
    else:
        out = weight * (h * inv_rms).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * out_stride_t + cols, out.to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False
) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)), or with `unit_offset` Gemma's (1 + weight) * ...,
    rounded as the reference; see `kernels.reference.rms_norm`. One program per token."""
    if validation.CHECK_ARGS:
        check_rms_norm_args(x, weight, eps)
        triton_attention.check_runnable(x.device)
    return _launch_rms_norm(x, None, weight, eps, unit_offset)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x IN PLACE, then (rms_norm(residual, weight, eps, unit_offset=unit_offset),
    residual), as the reference does; see `kernels.reference.fused_add_rms_norm`. One program
    per token: the row is read once, the sum written back once and the norm computed from
    registers."""
    if validation.CHECK_ARGS:
        check_fused_add_rms_norm_args(x, residual, weight, eps)
        triton_attention.check_runnable(x.device)
    return _launch_rms_norm(x, residual, weight, eps, unit_offset), residual


def _launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x,
        x if residual is None else residual,  # unused without a residual
        weight,
        out,
        float(eps),
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        out.stride(0),
        HIDDEN=hidden,
        BLOCK=block,
        ADD_RESIDUAL=residual is not None,
        UNIT_OFFSET=bool(unit_offset),
        num_warps=_norm_warps(block),
    )
    return out


def _norm_warps(block: int) -> int:
    # About 8 elements per thread (one 16-byte load of bfloat16), 1 to 16 warps.
    return min(max(block // 256, 1), 16)


# ------------------------------------------------------------------------------ SwiGLU, GeGLU


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    gate_up_stride_t,
    out_stride_t,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    ACTIVATION: tl.constexpr,  # "silu" or "gelu_tanh"
):
    """act(gate) * up for BLOCK columns of one row; the activation is computed in float32, as
    torch's F.silu / F.gelu compute it, and rounded to the dtype before the product."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    row = gate_up_ptr + token * gate_up_stride_t
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # F.silu(gate) / F.gelu(gate) is rounded to the dtype before .mul_(up) rounds the product.
    if ACTIVATION == "gelu_tanh":
        # torch's formula and order of operations, with tanh from exp2 (triton_attention.tanh_f32).
        inner = _GELU_BETA * (gate + _GELU_KAPPA * (gate * gate * gate))
        act = 0.5 * gate * (1.0 + tanh_f32(inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + token * out_stride_t + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * I] (gate | up) -> silu(gate) * up, [num_tokens, I]; see
    `kernels.reference.silu_and_mul`. A program per (token, 1024 columns)."""
    if validation.CHECK_ARGS:
        check_silu_and_mul_args(gate_up)
        triton_attention.check_runnable(gate_up.device)
    return _launch_act_and_mul(gate_up, "silu")


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * I] (gate | up) -> gelu_tanh(gate) * up, [num_tokens, I], with GELU's
    tanh approximation; see `kernels.reference.gelu_tanh_and_mul`. A program per (token, 1024
    columns)."""
    if validation.CHECK_ARGS:
        check_silu_and_mul_args(gate_up)
        triton_attention.check_runnable(gate_up.device)
    return _launch_act_and_mul(gate_up, "gelu_tanh")


def _launch_act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0 or intermediate == 0:
        return out
    block = min(triton.next_power_of_2(intermediate), _SILU_BLOCK)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=block,
        ACTIVATION=activation,
        num_warps=4,
    )
    return out


# -------------------------------------------------------------------------- rotary + KV cache


@triton.jit
def _rotate_heads(x_ptr, heads, half, mask, cos1, sin1, cos2, sin2, HEAD_DIM: tl.constexpr):
    """Rotate the heads x = [x1 | x2] at x_ptr + heads * HEAD_DIM (one token) by their angles:
    returns (x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2) in x's dtype, rounded as
    engine/models/rotary.py's apply_rotary rounds: rot(x) * sin to the dtype, then the sum (the
    product x * cos of two float16/bfloat16 values is exact in float32)."""
    dtype = x_ptr.dtype.element_ty
    row = x_ptr + heads[:, None] * HEAD_DIM + half[None, :]
    x1 = tl.load(row, mask=mask).to(tl.float32)
    x2 = tl.load(row + HEAD_DIM // 2, mask=mask).to(tl.float32)
    out1 = ((-x2 * sin1).to(dtype).to(tl.float32) + x1 * cos1).to(dtype)
    out2 = ((x1 * sin2).to(dtype).to(tl.float32) + x2 * cos2).to(dtype)
    return out1, out2


@triton.jit
def _rotary_and_cache_kernel(
    qkv_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_out_ptr,
    max_positions,
    num_slots,
    qkv_stride_t,
    cos_stride,
    sin_stride,
    k_stride_slot,
    k_stride_h,
    v_stride_slot,
    v_stride_h,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_KV_SCALES: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,  # 0: the cache is in qkv's dtype
    FP8_MIN_EXP: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """One token: a qkv row is [q heads | k heads | v heads], each head [x1 | x2] of HEAD_DIM / 2
    dims, rotated pairwise as (x1[i], x2[i]) with the angles in the table row of its position.
    Into an fp8 cache, the rotated k (rounded to qkv's dtype, as the reference's) and v are
    quantized as `quantize_fp8` does."""
    token = tl.program_id(0).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + token)
    pos = tl.minimum(tl.maximum(pos, 0), max_positions - 1)  # see the module docstring
    half = tl.arange(0, BLOCK_HALF)
    half_ok = half < HEAD_DIM // 2
    # The tables are float32; the reference casts them to the activations' dtype first.
    cos_row = cos_ptr + pos * cos_stride + half
    sin_row = sin_ptr + pos * sin_stride + half
    cos1 = tl.load(cos_row, mask=half_ok).to(dtype).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + HEAD_DIM // 2, mask=half_ok).to(dtype).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row, mask=half_ok).to(dtype).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + HEAD_DIM // 2, mask=half_ok).to(dtype).to(tl.float32)[None, :]
    row = qkv_ptr + token * qkv_stride_t

    hq = tl.arange(0, BLOCK_HQ)
    q_mask = (hq < NUM_HEADS)[:, None] & half_ok[None, :]
    q1, q2 = _rotate_heads(row, hq, half, q_mask, cos1, sin1, cos2, sin2, HEAD_DIM)
    q_out = q_out_ptr + token * (NUM_HEADS * HEAD_DIM) + hq[:, None] * HEAD_DIM + half[None, :]
    tl.store(q_out, q1, mask=q_mask)
    tl.store(q_out + HEAD_DIM // 2, q2, mask=q_mask)

    slot = tl.load(slot_mapping_ptr + token)
    # Padding tokens (negative slot) and slots past the cache are not written.
    if (slot >= 0) & (slot < num_slots):
        hk = tl.arange(0, BLOCK_HKV)
        kv_mask = (hk < NUM_KV_HEADS)[:, None] & half_ok[None, :]
        k_row = row + NUM_HEADS * HEAD_DIM
        k1, k2 = _rotate_heads(k_row, hk, half, kv_mask, cos1, sin1, cos2, sin2, HEAD_DIM)
        v_src = k_row + NUM_KV_HEADS * HEAD_DIM + hk[:, None] * HEAD_DIM + half[None, :]
        v1 = tl.load(v_src, mask=kv_mask)
        v2 = tl.load(v_src + HEAD_DIM // 2, mask=kv_mask)
        if FP8_MANTISSA > 0:
            k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, HAS_KV_SCALES)
            k1 = quantize_fp8(
                k1, k_scale, k_cache_ptr.dtype.element_ty, HAS_KV_SCALES, FP8_MANTISSA,
                FP8_MIN_EXP, FP8_MAX,
            )  # fmt: skip
            k2 = quantize_fp8(
                k2, k_scale, k_cache_ptr.dtype.element_ty, HAS_KV_SCALES, FP8_MANTISSA,
                FP8_MIN_EXP, FP8_MAX,
            )  # fmt: skip
            v1 = quantize_fp8(
                v1, v_scale, v_cache_ptr.dtype.element_ty, HAS_KV_SCALES, FP8_MANTISSA,
                FP8_MIN_EXP, FP8_MAX,
            )  # fmt: skip
            v2 = quantize_fp8(
                v2, v_scale, v_cache_ptr.dtype.element_ty, HAS_KV_SCALES, FP8_MANTISSA,
                FP8_MIN_EXP, FP8_MAX,
            )  # fmt: skip
        k_dst = k_cache_ptr + slot * k_stride_slot + hk[:, None] * k_stride_h + half[None, :]
        tl.store(k_dst, k1, mask=kv_mask)
        tl.store(k_dst + HEAD_DIM // 2, k2, mask=kv_mask)
        v_dst = v_cache_ptr + slot * v_stride_slot + hk[:, None] * v_stride_h + half[None, :]
        tl.store(v_dst, v1, mask=kv_mask)
        tl.store(v_dst + HEAD_DIM // 2, v2, mask=kv_mask)


def rotary_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotary embedding of q and k from the qkv projection and the KV-cache write (quantized into
    an fp8 cache), in one pass over qkv; see `kernels.reference.rotary_and_cache`. One program
    per token.

    Unlike the reference, a position outside the tables is clamped into them and a slot past
    the end of the cache is skipped instead of raising: the checks would need the host.
    """
    if validation.CHECK_ARGS:
        check_rotary_and_cache_args(
            qkv, positions, cos_table, sin_table, k_cache, v_cache, slot_mapping,
            num_heads, num_kv_heads, head_dim, k_scale, v_scale,
        )  # fmt: skip
        triton_attention.check_runnable(qkv.device)
    num_tokens = qkv.shape[0]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    _rotary_and_cache_kernel[(num_tokens,)](
        qkv,
        positions,
        cos_table,
        sin_table,
        k_cache,
        v_cache,
        slot_mapping,
        *kv_scale_args(k_cache, k_scale, v_scale),
        q,
        cos_table.shape[0],
        k_cache.shape[0] * k_cache.shape[1],
        qkv.stride(0),
        cos_table.stride(0),
        sin_table.stride(0),
        # A slot (block * block_size + offset) steps by stride(1); the validation checks
        # stride(0) == block_size * stride(1).
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        **fp8_write_constexprs(k_cache, k_scale, v_scale),
        num_warps=4,
    )
    return q
