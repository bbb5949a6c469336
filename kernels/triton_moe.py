"""Fused mixture-of-experts Triton kernels: the GPU twin of `kernels.reference.fused_moe`, with
the same signature and semantics.

The reference loops over the experts on the host (one pair of matmuls per expert that received
tokens, after a `.tolist()` of the counts). Here, as in vLLM's and SGLang's fused MoE, the whole
layer is three launches whose grids come from shapes only, so it can be captured in a CUDA graph:

1. Align (torch ops on the device). The num_pairs = num_tokens * top_k (token, k) pairs are
   sorted by expert, and each expert's run is padded to a multiple of BLOCK_M with the sentinel
   num_pairs, so that every BLOCK_M tile of the sorted list belongs to one expert:

       experts of pairs p = t * top_k + k = 0..5:   3 1 0 1 3 3    (E = 4, BLOCK_M = 2, P = 6)
       sorted_pair_ids      2 P | 1 3 | 0 4 | 5 P | P P
       block_experts        0   | 1   | 3   | 3   | 4      expert 2 got none, so no tile; the
                                                          last tile is spare (expert E = 4)

   The number of tiles depends on the routing, so the buffers are sized for the worst case of
   the shapes (`_max_blocks`) and tiles past the last real one are marked with expert E.
2. gate_up: program (tile, n) multiplies the tile's BLOCK_M rows of x by BLOCK_N gate columns
   and the BLOCK_N up columns I further of its expert's gate_up, and writes act(gate) * up to
   the [num_pairs, I] intermediate in the pairs' own order.
3. down: program (tile, n) multiplies the tile's intermediate rows by BLOCK_N columns of its
   expert's down, scales by the pair's routing weight and writes [num_pairs, hidden].
Then a third kernel sums each token's top_k rows, in the order of their expert ids, so the
result is deterministic (no atomics) and rounded as the reference's per-expert index_add_ is.

Rounding: the matmuls accumulate in float32 and every intermediate is rounded to the dtype
where the reference rounds (each projection, the activation, its product with up, the down
projection, its product with the float32 weight, each partial sum), so float32 agrees with the
reference to about 1e-6 relative, and float16/bfloat16 to an ulp or two of a matmul summed in
another order. gelu_tanh is computed as x * sigmoid(2 * inner), which equals
0.5 * x * (1 + tanh(inner)) without tanh (not in every Triton version) and without its
cancellation for negative x.

Expert ids must lie in [0, E): checking them would need the host (the reference raises, here an
out-of-range id trips a device-side assert in the alignment's scatter).

Under TRITON_INTERPRET=1 (set before this module is imported) the same kernels run on CPU tensors
with numpy; tests/kernels/test_moe.py uses that to check them against the reference. Two
interpreter bugs would hide bfloat16 behind noise: it multiplies a bfloat16 tl.dot's raw bit
patterns (triton-lang/triton#11584) and it truncates float32 to bfloat16. So there, and only
there (the INTERP_BF16 constexpr), bfloat16 tiles are widened to float32 (exactly) before the dot
and results are rounded to nearest on their bits; compiled kernels use the native dot and cast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels import triton_attention, validation
from pagedserve.kernels.validation import check_fused_moe_args

__all__ = ["MoeConfig", "align", "experts", "fused_moe", "moe_config"]

# GELU's tanh approximation: 0.5 * x * (1 + tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x^3))).
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
# Columns per program of the top_k sum.
_SUM_BLOCK = 1024


@dataclass(frozen=True)
class MoeConfig:
    """Launch parameters of the two grouped matmuls: rows (sorted pairs) per tile, output columns
    and reduction depth per program, warps and software-pipeline stages. block_m is also the
    alignment of each expert's run of pairs."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def moe_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """Default launch parameters for a batch of `num_tokens` tokens.

    Untuned starting points, after vLLM's fallback for shapes it has no tuned table for: 16-row
    tiles while the tokens are no more than the experts (decode: most experts get a few rows
    or none, and padding a run to 64 rows would multiply wasted work), 64-row tiles above. The
    H200 sweep is what should set them (`python -m benchmarks.gpu_kernels --only moe` times
    this default; tl.dot needs every block dim >= 16).
    """
    if num_tokens <= num_experts:
        return MoeConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=3)
    return MoeConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)


# ------------------------------------------------------------------------------------- align


def _max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Most BLOCK_M tiles any routing of num_pairs pairs to num_experts experts can need.

    With c_e pairs for expert e and nz experts that got any, the tiles number
    sum ceil(c_e / BLOCK_M) = sum (floor((c_e - 1) / BLOCK_M) + 1) <= (P - nz) // BLOCK_M + nz,
    which grows with nz <= min(E, P). A decode step of one token and top_k 8 over 128 experts
    gets 8 tiles rather than the (8 + 128 * (BLOCK_M - 1)) / BLOCK_M of a bound on the padded
    length alone."""
    most = min(num_experts, num_pairs)
    return (num_pairs - most) // block_m + most


def align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, k) pairs by expert, each expert's run padded to a multiple of block_m.

    Returns (sorted_pair_ids, block_experts): sorted_pair_ids [num_blocks * block_m] int32 holds
    pair indices t * top_k + k (ascending within an expert), num_pairs where a run is padded or
    past the last tile; block_experts [num_blocks] int32 is the expert of each tile, num_experts
    past the last. num_blocks = `_max_blocks(...)`, from shapes only; torch ops only, none of
    which waits for the device."""
    device = topk_ids.device
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    num_blocks = _max_blocks(num_pairs, num_experts, block_m)
    # scatter_add_ rather than bincount, which reads the largest id back to the host on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_ends = ((counts + block_m - 1) // block_m * block_m).cumsum(0)
    padded_starts = padded_ends - (counts + block_m - 1) // block_m * block_m
    starts = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)  # pairs by expert, then by pair index
    experts_sorted = flat[order]
    rank = torch.arange(num_pairs, device=device) - starts[experts_sorted]
    sorted_pair_ids = torch.full(
        (num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device
    )
    sorted_pair_ids.scatter_(0, padded_starts[experts_sorted] + rank, order.to(torch.int32))
    # The tile starting at row b * block_m belongs to the first expert whose padded run ends
    # after it (experts without pairs end where they start, so they are passed over).
    tile_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, tile_starts, right=True).to(torch.int32)
    return sorted_pair_ids, block_experts


# ---------------------------------------------------------------------------- grouped matmuls


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERP_BF16: tl.constexpr):
    """float32 x rounded to `dtype`, to nearest even. The interpreter truncates float32 to
    bfloat16, so with INTERP_BF16 the rounding is done on the bits (finite x; the carry out of
    the mantissa is the exponent's increment)."""
    if INTERP_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    return x.to(dtype)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,
    w_ptr,  # gate_up [E, 2 * INTER, HIDDEN]
    h_ptr,  # out: [num_pairs, INTER]
    sorted_pair_ids_ptr,
    block_experts_ptr,
    num_pairs,
    num_experts,
    x_stride_t,
    w_stride_e,
    w_stride_n,
    w_stride_k,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    GELU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    """Program (tile, n): h[pair, cols] = act(x[t] . gate[e, cols]) * (x[t] . up[e, cols]) for
    the tile's pairs (t = pair // TOP_K) and cols = n * BLOCK_N + [0, BLOCK_N)."""
    tile = tl.program_id(0)
    expert = tl.load(block_experts_ptr + tile).to(tl.int64)
    if expert >= num_experts:  # past the last tile of this routing
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + rows).to(tl.int64)
    row_ok = pairs < num_pairs  # padding rows load zeros and store nothing
    tokens = pairs // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * x_stride_t + ks[None, :]
    # [BLOCK_K, BLOCK_N] tiles of gate^T and up^T: element (k, n) is gate_up[e, n, k].
    g_ptrs = w_ptr + expert * w_stride_e + cols[None, :] * w_stride_n + ks[:, None] * w_stride_k
    u_ptrs = g_ptrs + INTER * w_stride_n
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        # Without a mask along k when it divides HIDDEN: the contiguous dim then loads in
        # 16-byte vectors.
        if HIDDEN % BLOCK_K == 0:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < HIDDEN - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if INTERP_BF16:  # see the module docstring
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_gate = tl.dot(a, g, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, u, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * w_stride_k
        u_ptrs += BLOCK_K * w_stride_k
    dtype = h_ptr.dtype.element_ty
    # Rounded as the reference rounds: the projection (F.linear's output), the activation
    # (F.silu / F.gelu compute in float32 and round), then its product with up.
    gate = round_to(acc_gate, dtype, INTERP_BF16).to(tl.float32)
    up = round_to(acc_up, dtype, INTERP_BF16).to(tl.float32)
    if GELU:
        inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * inner))  # 0.5 * x * (1 + tanh(inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = round_to(act, dtype, INTERP_BF16).to(tl.float32)
    h = round_to(act * up, dtype, INTERP_BF16)
    tl.store(
        h_ptr + pairs[:, None] * INTER + cols[None, :], h, mask=row_ok[:, None] & col_ok[None, :]
    )


@triton.jit
def _moe_down_kernel(
    h_ptr,  # [num_pairs, INTER]
    w_ptr,  # down [E, HIDDEN, INTER]
    y_ptr,  # out: [num_pairs, HIDDEN]
    topk_weights_ptr,  # [num_pairs] float32
    sorted_pair_ids_ptr,
    block_experts_ptr,
    num_pairs,
    num_experts,
    w_stride_e,
    w_stride_n,
    w_stride_k,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    """Program (tile, n): y[pair, cols] = weight[pair] * (h[pair] . down[e, cols]) for the tile's
    pairs and cols = n * BLOCK_N + [0, BLOCK_N)."""
    tile = tl.program_id(0)
    expert = tl.load(block_experts_ptr + tile).to(tl.int64)
    if expert >= num_experts:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + rows).to(tl.int64)
    row_ok = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < HIDDEN
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + pairs[:, None] * INTER + ks[None, :]
    b_ptrs = w_ptr + expert * w_stride_e + cols[None, :] * w_stride_n + ks[:, None] * w_stride_k
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        if INTER % BLOCK_K == 0:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < INTER - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if INTERP_BF16:  # see the module docstring
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * w_stride_k
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0)
    # The reference rounds F.linear's output, multiplies by the float32 weight (promoting to
    # float32) and rounds the product.
    y = round_to(acc, dtype, INTERP_BF16).to(tl.float32) * weight[:, None]
    y = round_to(y, dtype, INTERP_BF16)
    tl.store(
        y_ptr + pairs[:, None] * HIDDEN + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :]
    )


@triton.jit
def _moe_sum_kernel(
    y_ptr,  # [num_tokens * TOP_K, HIDDEN], each token's rows in the order of their expert ids
    out_ptr,  # [num_tokens, HIDDEN]
    out_stride_t,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    """Program (token, chunk): out[t] = y[t, 0] + y[t, 1] + ..., rounded to the dtype after each
    add as the reference's index_add_ per expert (in expert order) rounds. (float32 holds the sum
    of two float16/bfloat16 values closely enough that rounding it once more is exact.)"""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    dtype = out_ptr.dtype.element_ty
    rows = y_ptr + token * TOP_K * HIDDEN + cols
    total = tl.load(rows, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(1, TOP_K):
        y = tl.load(rows + k * HIDDEN, mask=mask, other=0.0).to(tl.float32)
        total = round_to(total + y, dtype, INTERP_BF16).to(tl.float32)
    tl.store(out_ptr + token * out_stride_t + cols, total.to(dtype), mask=mask)


# ------------------------------------------------------------------------------------ wrappers


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    """The experts of a mixture-of-experts layer; see `kernels.reference.fused_moe` (same
    signature, same result up to the order of the matmuls' sums). Launch parameters from
    `moe_config`."""
    if validation.CHECK_ARGS:
        check_fused_moe_args(x, gate_up, down, topk_weights, topk_ids, activation)
        triton_attention.check_runnable(x.device)
    config = moe_config(x.shape[0], topk_ids.shape[1], gate_up.shape[0])
    return experts(x, gate_up, down, topk_weights, topk_ids, activation, config)


def experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    config: MoeConfig,
) -> torch.Tensor:
    """`fused_moe` with a given launch configuration (tests force small tiles, the benchmark may
    sweep them) and without the argument checks."""
    num_tokens, hidden = x.shape
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or hidden == 0:
        return out
    if top_k == 0 or inter == 0:
        return out.zero_()
    if x.stride(1) != 1:
        x = x.contiguous()
    if top_k > 1:
        # Each token's pairs in the order of their expert ids, the order in which the reference
        # adds the experts' outputs (ids of one token are distinct, as top-k's are).
        topk_ids, perm = topk_ids.sort(dim=1)
        topk_weights = topk_weights.gather(1, perm)
    topk_weights = topk_weights.contiguous()
    num_pairs = num_tokens * top_k
    sorted_pair_ids, block_experts = align(topk_ids, num_experts, config.block_m)
    num_blocks = block_experts.shape[0]
    interp_bf16 = triton_attention.INTERPRETED and x.dtype == torch.bfloat16
    # float32 stays float32 (TF32 would round the operands to 10 mantissa bits); the option is
    # ignored for 16-bit operands.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "PRECISION": precision,
        "INTERP_BF16": interp_bf16,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, config.block_n))](
        x,
        gate_up,
        h,
        sorted_pair_ids,
        block_experts,
        num_pairs,
        num_experts,
        x.stride(0),
        *gate_up.stride(),
        TOP_K=top_k,
        HIDDEN=hidden,
        INTER=inter,
        GELU=activation == "gelu_tanh",
        **launch,
    )
    # With one expert per token the down projection's rows are the output rows.
    y = out if top_k == 1 else torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, config.block_n))](
        h,
        down,
        y,
        topk_weights,
        sorted_pair_ids,
        block_experts,
        num_pairs,
        num_experts,
        *down.stride(),
        HIDDEN=hidden,
        INTER=inter,
        **launch,
    )
    if top_k > 1:
        block = min(triton.next_power_of_2(hidden), _SUM_BLOCK)
        _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
            y,
            out,
            out.stride(0),
            TOP_K=top_k,
            HIDDEN=hidden,
            BLOCK=block,
            INTERP_BF16=interp_bf16,
            num_warps=4,
        )
    return out
