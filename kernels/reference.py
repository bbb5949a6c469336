"""Pure-torch paged attention and KV-cache write.

These are the engine's CPU path and the oracle the Triton kernels are tested against, so they
share the kernels' signatures exactly. Both work on any device torch supports.

Index arithmetic, for one sequence with block_size = 4, seq_len = 10 and q_len = 3 new tokens
(7 cached), whose block-table row is [7, 2, 5, <pad>, ...]:

    position p           0  1  2  3 | 4  5  6  7 | 8  9  -  -
    logical block p//4        0     |     1      |     2
    physical block            7     |     2      |     5        (block_table[i, p // 4])
    slot                28 29 30 31 | 8  9 10 11 |20 21 22 23   (block * 4 + p % 4)

Gathering k_cache[block_table[i, :3]] gives 12 keys whose index equals their position; slots 22
and 23 are not written yet. New token j sits at position seq_len - q_len + j = 7 + j and sees
every key at a position <= its own (and > its position - sliding_window, when set):

    key position ->        0 1 2 3 4 5 6 7 8 9 10 11
    new token 0 (pos 7)    x x x x x x x x . .  .  .
    new token 1 (pos 8)    x x x x x x x x x .  .  .
    new token 2 (pos 9)    x x x x x x x x x x  .  .

Masked keys get exactly zero weight, but 0 * NaN is still NaN: cache slots that were never
written must hold finite values (the engine allocates its caches with torch.zeros).

fp8 caches (`kernels.fp8`): the writes quantize (`quantize_kv`, with k_scale / v_scale) and the
attention gathers the fp8 blocks (one byte per element) and dequantizes only the gathered keys and
values, to q's dtype (`dequantize_kv`). torch's CPU index_copy_ has no fp8 kernels, so fp8 caches
are written and copied through a uint8 view of the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pagedserve.kernels import validation
from pagedserve.kernels.fp8 import dequantize_kv, is_fp8, quantize_kv
from pagedserve.kernels.validation import (
    check_copy_blocks_args,
    check_fused_add_rms_norm_args,
    check_fused_moe_args,
    check_paged_attention_args,
    check_reshape_and_cache_args,
    check_rms_norm_args,
    check_rotary_and_cache_args,
    check_silu_and_mul_args,
)

__all__ = [
    "copy_blocks",
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_tanh_and_mul",
    "moe_route",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_and_cache",
    "silu_and_mul",
]

# Padding keys not worth a separate SDPA call (each call has a fixed cost that a few padded keys
# do not outweigh).
_MIN_PADDING = 128


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
    """Write each token's key and value into its cache slot.

    key, value: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place; in
        key's dtype, or fp8 (then key / k_scale and value / v_scale are stored, saturated: see
        `kernels.fp8`)
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; a token whose slot
        is negative is padding and is not written.
    k_scale, v_scale: float32 [1] tensors for an fp8 cache (None: 1.0); refused with any other
        cache by the argument checks
    """
    if validation.CHECK_ARGS:
        check_reshape_and_cache_args(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if key.shape[0] == 0:
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    lowest, highest = torch.stack(torch.aminmax(slot_mapping)).tolist()
    if highest >= num_slots:
        raise ValueError(
            f"slot_mapping holds slot {highest}, but the cache has only {num_slots} slots "
            f"({k_cache.shape[0]} blocks x {k_cache.shape[1]})"
        )
    if lowest < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if is_fp8(k_cache.dtype):
        key = quantize_kv(key, k_scale, k_cache.dtype).view(torch.uint8)
        value = quantize_kv(value, v_scale, v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    # The validation guarantees the block and offset dims merge into one slot dim without a copy.
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def copy_blocks(caches: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy KV block `src[i]` into block `dst[i]` in every cache (copy-on-write of shared
    blocks).

    caches: every layer's key and value cache, [num_blocks, block_size, num_kv_heads, head_dim],
        all alike and contiguous, written in place; fp8 caches are copied as their bytes
    src, dst: [num_copies] int64 block ids; no block is both a source and a destination, and
        none is a destination twice, so the copies are independent of their order.
    """
    if validation.CHECK_ARGS:
        check_copy_blocks_args(caches, src, dst)
    if src.numel() == 0:
        return
    for cache in caches:
        if is_fp8(cache.dtype):
            cache = cache.view(torch.uint8)
        cache.index_copy_(0, dst, cache.index_select(0, src))


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
    """Causal attention of each sequence's new tokens over its paged K/V.

    q: [num_tokens, num_heads, head_dim], the new tokens of all sequences, concatenated
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; the new tokens' K/V must
        already be written (`reshape_and_cache`). In q's dtype, or fp8: then keys and values are
        read as cache * k_scale (v_scale), rounded to q's dtype (`kernels.fp8`)
    block_tables: [num_seqs, max_blocks_per_seq] int32; entries past a sequence's last block are
        ignored and may hold anything
    seq_lens: [num_seqs] int32, context length including the new tokens
    query_start_loc: [num_seqs + 1] int32, cumulative new-token counts
    scale: multiplies q @ k^T (the model passes 1 / sqrt(head_dim))
    sliding_window: when set, a token at position p sees keys at positions p - sliding_window + 1
        .. p only
    softcap: when set, each score s = scale * q . k is capped to softcap * tanh(s / softcap)
        before the mask and the softmax (Gemma 2's attention-logit soft-capping)
    out: optional contiguous [num_tokens, num_heads, head_dim] tensor that receives the result
    k_scale, v_scale: float32 [1] tensors for an fp8 cache (None: 1.0); refused with any other
        cache by the argument checks

    Returns the attention output, [num_tokens, num_heads, head_dim] (`out` when given). Query head
    h reads kv head h // (num_heads // num_kv_heads).

    Decode sequences (one new token) and prefill/extend sequences are attended to in separate
    batched SDPA calls, each batch padded to its longest member; a kind is split into more
    batches only when its context lengths differ by more than 2x plus _MIN_PADDING keys (see
    `_buckets`). The host reads seq_lens and query_start_loc once; the only other sync is the
    `nonzero` over real rows of a batch whose sequences have unequal new-token counts.
    """
    if validation.CHECK_ARGS:
        check_paged_attention_args(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
            out, softcap, k_scale, v_scale,
        )  # fmt: skip
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = block_tables.shape[0]
    host = torch.cat([seq_lens, query_start_loc]).tolist()
    seq_lens_h, query_start_h = host[:num_seqs], host[num_seqs:]
    q_lens = check_lengths(seq_lens_h, query_start_h, q.shape[0], block_tables, k_cache.shape[1])

    decode = [i for i, n in enumerate(q_lens) if n == 1]
    extend = [i for i, n in enumerate(q_lens) if n > 1]
    for kind in (decode, extend):
        for seqs in _buckets(kind, seq_lens_h):
            _attend(
                q,
                k_cache,
                v_cache,
                block_tables,
                seq_lens,
                seqs,
                [seq_lens_h[i] for i in seqs],
                [query_start_h[i] for i in seqs],
                [q_lens[i] for i in seqs],
                scale,
                sliding_window,
                softcap,
                out,
                k_scale,
                v_scale,
            )
    return out


def check_lengths(
    seq_lens: list[int],
    query_start_loc: list[int],
    num_tokens: int,
    block_tables: torch.Tensor,
    block_size: int,
) -> list[int]:
    """Check the host copies of seq_lens / query_start_loc and return the per-sequence q_lens."""
    if query_start_loc[0] != 0 or query_start_loc[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc must run from 0 to num_tokens = {num_tokens}, "
            f"got {query_start_loc[0]} .. {query_start_loc[-1]}"
        )
    capacity = block_tables.shape[1] * block_size
    q_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:], strict=False)]
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        if q_len < 0:
            raise ValueError(
                f"query_start_loc must be non-decreasing, but entry {i + 1} "
                f"({query_start_loc[i + 1]}) < entry {i} ({query_start_loc[i]})"
            )
        if q_len > seq_len:
            raise ValueError(f"sequence {i} has {q_len} new tokens but seq_len {seq_len}")
        if seq_len > capacity:
            raise ValueError(
                f"sequence {i} has seq_len {seq_len}, but a block-table row holds only "
                f"{block_tables.shape[1]} blocks x {block_size} = {capacity} tokens"
            )
    return q_lens


def _buckets(seqs: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Split `seqs` into batches whose contexts are alike, as every batch is padded to its longest.

    A batch is cut when a context exceeds twice the batch's shortest plus _MIN_PADDING keys, so
    padding at most about doubles the work, and short contexts are never split for a few keys.
    The common case (one batch) keeps the caller's order.
    """
    if not seqs:
        return []
    lens = [seq_lens[i] for i in seqs]
    if max(lens) <= 2 * min(lens) + _MIN_PADDING:
        return [seqs]
    batches: list[list[int]] = []
    for i in sorted(seqs, key=seq_lens.__getitem__):
        if not batches or seq_lens[i] > 2 * seq_lens[batches[-1][0]] + _MIN_PADDING:
            batches.append([])
        batches[-1].append(i)
    return batches


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """SDPA with the scores capped to cap * tanh(scores / cap) first, in transformers' order
    (scores in q's dtype, softmax in float32, probabilities rounded back before the product)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _gather_kv(
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
) -> torch.Tensor:
    """[num_blocks, block_size, H, D] cache, [B, nb] block ids -> [B, H, nb * block_size, D].

    One copy (index_select, several times faster on CPU than advanced indexing); the result is a
    transposed view, whose strides SDPA's CPU kernel takes as they are. An fp8 cache is gathered
    as bytes and only the gathered values are dequantized (times `scale`) to `dtype`, q's.
    """
    batch, num_blocks_per_seq = block_ids.shape
    _, block_size, num_heads, head_dim = cache.shape
    fp8 = is_fp8(cache.dtype)
    source = cache.view(torch.uint8) if fp8 else cache
    gathered = source.index_select(0, block_ids.flatten())  # [B * nb, block_size, H, D]
    if fp8:
        gathered = dequantize_kv(gathered.view(cache.dtype), scale, dtype)
    return gathered.view(batch, num_blocks_per_seq * block_size, num_heads, head_dim).transpose(
        1, 2
    )


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seqs: list[int],
    group_seq_lens: list[int],
    group_starts: list[int],
    group_q_lens: list[int],
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Attend the new tokens of sequences `seqs` in one SDPA call, writing their rows of `out`.

    Every sequence is padded to max_q new tokens and L = nb * block_size keys. Padding query rows
    repeat the sequence's last real token (so no row is fully masked) and are dropped on output.
    Query heads are folded into rows, [B, Hkv, max_q * G, D], so K/V are never repeated for GQA.
    With a sliding window, the blocks before the earliest key any of them sees are skipped: the
    keys run from block `first` on, so the work is the window's, not the whole context's.
    """
    device = q.device
    num_seqs = block_tables.shape[0]
    batch = len(seqs)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    max_q = max(group_q_lens)
    num_blocks = (max(group_seq_lens) - 1) // block_size + 1  # through the last key's block
    first = 0
    if sliding_window is not None:
        earliest = min(n - q for n, q in zip(group_seq_lens, group_q_lens, strict=True))
        first = max(0, earliest - sliding_window + 1) // block_size
    num_keys = (num_blocks - first) * block_size
    uniform = all(n == max_q for n in group_q_lens)
    whole = batch == num_seqs and seqs == list(range(num_seqs))
    # The whole step, every sequence with max_q new tokens: q already is [B, max_q, H, D].
    dense = whole and uniform

    if whole:
        lens = seq_lens.long()
        block_ids = block_tables[:, first:num_blocks]
    else:
        lens = torch.tensor(group_seq_lens, device=device)
        block_ids = block_tables[torch.tensor(seqs, device=device), first:num_blocks]
    # Entries past a sequence's last block may be garbage (even out of range): point them at the
    # sequence's own first block, whose keys the mask hides. Not a fixed block such as 0: masked
    # keys still reach the weighted sum (as 0 * value), so a NaN in another request's block would
    # poison this one.
    used = (
        torch.arange(first, num_blocks, device=device)
        < (lens[:, None] + block_size - 1) // block_size
    )
    block_ids = torch.where(used, block_ids, block_ids[:, :1])
    k = _gather_kv(k_cache, block_ids, q.dtype, k_scale)
    v = _gather_kv(v_cache, block_ids, q.dtype, v_scale)

    steps = torch.arange(max_q, device=device)
    if uniform:
        q_lens = None
        offsets = steps[None, :]  # [1, max_q]
        positions = (lens - max_q)[:, None] + offsets
    else:
        q_lens = torch.tensor(group_q_lens, device=device)
        offsets = torch.minimum(steps[None, :], q_lens[:, None] - 1)  # [B, max_q]
        positions = (lens - q_lens)[:, None] + offsets
    if dense:
        q_padded = q.view(batch, max_q, num_heads, head_dim)
        rows = None
    else:
        rows = torch.tensor(group_starts, device=device)[:, None] + offsets  # [B, max_q]
        q_padded = q.index_select(0, rows.flatten()).view(batch, max_q, num_heads, head_dim)
    key_positions = torch.arange(first * block_size, num_blocks * block_size, device=device)
    mask = key_positions <= positions[:, :, None]  # [B, max_q, L]
    if sliding_window is not None:
        mask &= key_positions > positions[:, :, None] - sliding_window

    # Row r = t * G + g of kv head h holds query head h * G + g of new token t.
    q_folded = (
        q_padded.view(batch, max_q, num_kv_heads, group, head_dim)
        .permute(0, 2, 1, 3, 4)
        .reshape(batch, num_kv_heads, max_q * group, head_dim)
    )
    if max_q == 1:
        mask = mask.view(batch, 1, 1, num_keys)
    else:
        mask = (
            mask[:, None, :, None, :]
            .expand(batch, 1, max_q, group, num_keys)
            .reshape(batch, 1, max_q * group, num_keys)
        )
    if softcap is None:
        o = F.scaled_dot_product_attention(q_folded, k, v, attn_mask=mask, scale=float(scale))
    else:
        o = _softcapped_attention(q_folded, k, v, mask, float(scale), float(softcap))
    o = o.view(batch, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)

    if rows is None:
        out.view(batch, max_q, num_kv_heads, group, head_dim).copy_(o)
    elif q_lens is None:
        out.index_copy_(0, rows.flatten(), o.reshape(-1, num_heads, head_dim))
    else:
        real = (steps[None, :] < q_lens[:, None]).flatten().nonzero().squeeze(1)
        o = o.reshape(-1, num_heads, head_dim).index_select(0, real)
        out.index_copy_(0, rows.flatten().index_select(0, real), o)


# ----------------------------------------------------------------------------- fused layer ops
# The Llama decoder's non-attention ops, in transformers' math and rounding order (as
# engine/models/rotary.py apply_rotary rounds), so the engine, which calls them for every layer,
# produces transformers' tokens. `kernels.triton_fused` has the same signatures.


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False
) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)): normalised in float32 and rounded to x's dtype
    before the weight multiplies (in x's dtype), as transformers' Llama norm does.

    unit_offset: Gemma's norm instead, which stores weight - 1: the normalised row is multiplied
    by (1 + weight) in float32 and rounded once at the end, as transformers' Gemma norms do.

    x: [num_tokens, hidden_size], any float dtype; weight: [hidden_size] in x's dtype.
    Returns a new [num_tokens, hidden_size] tensor in x's dtype.
    """
    if validation.CHECK_ARGS:
        check_rms_norm_args(x, weight, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt((x32 * x32).mean(-1, keepdim=True).add_(eps))
    if unit_offset:
        return normed.mul_(weight.float() + 1.0).to(x.dtype)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual connection and the next norm: residual += x, then rms_norm(residual).

    x, residual: [num_tokens, hidden_size], same dtype. `residual` is updated IN PLACE to
    x + residual (rounded to the dtype, as `x + residual` is) and returned as the second result;
    the first is a new tensor, rms_norm(x + residual, weight, eps, unit_offset=unit_offset).
    """
    if validation.CHECK_ARGS:
        check_fused_add_rms_norm_args(x, residual, weight, eps)
    residual.add_(x)
    return rms_norm(residual, weight, eps, unit_offset=unit_offset), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: [num_tokens, 2 * I] (gate | up) -> silu(gate) * up, [num_tokens, I]
    in the input dtype; silu is rounded to the dtype before the product, as transformers does."""
    if validation.CHECK_ARGS:
        check_silu_and_mul_args(gate_up)
    gate, up = gate_up.split(gate_up.shape[1] // 2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's GeGLU activation: [num_tokens, 2 * I] (gate | up) -> gelu_tanh(gate) * up, with
    GELU's tanh approximation (transformers' "gelu_pytorch_tanh"), rounded to the dtype before
    the product as `silu_and_mul` rounds."""
    if validation.CHECK_ARGS:
        check_silu_and_mul_args(gate_up)
    gate, up = gate_up.split(gate_up.shape[1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


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
    """Rotary embedding of q and k straight from the qkv projection, and the KV-cache write.

    qkv: [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], the q heads, then k, then v
    positions: [num_tokens] int64, each token's position (a row of the tables)
    cos_table, sin_table: [max_positions, head_dim] float32 in the Hugging Face "rotate half"
        layout (engine/models/rotary.py RotaryEmbedding.cos / .sin); cast to qkv's dtype before use
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] in qkv's dtype or fp8;
        rotated k (rounded to qkv's dtype) and raw v are written to slot_mapping's slots
        (negative = padding, not written), as `reshape_and_cache` does, quantized with k_scale /
        v_scale into an fp8 cache
    Returns the rotated q, a new [num_tokens, num_heads, head_dim] tensor.
    """
    if validation.CHECK_ARGS:
        check_rotary_and_cache_args(
            qkv, positions, cos_table, sin_table, k_cache, v_cache, slot_mapping,
            num_heads, num_kv_heads, head_dim, k_scale, v_scale,
        )  # fmt: skip
    n = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    cos = cos_table[positions].to(qkv.dtype).unsqueeze(1)  # [N, 1, D]
    sin = sin_table[positions].to(qkv.dtype).unsqueeze(1)
    # Rotating q and k apart gives the same elements as the model's one call on [N, Hq + Hkv, D]
    # (the ops are elementwise) and a contiguous q.
    q = _rotate_half(qkv[:, :q_size].view(n, num_heads, head_dim), cos, sin)
    k = _rotate_half(qkv[:, q_size : q_size + kv_size].view(n, num_kv_heads, head_dim), cos, sin)
    v = qkv[:, q_size + kv_size :].view(n, num_kv_heads, head_dim)
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rot(x) * sin with rot([x1 | x2]) = [-x2 | x1], rounded as engine/models/rotary.py's
    apply_rotary rounds: rot(x) * sin to x's dtype, then the sum."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    rotated.mul_(sin)
    return rotated.addcmul_(x, cos)


# ----------------------------------------------------------------------- mixture of experts


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts and their weights from the router's logits [num_tokens, E]:
    softmax in float32, the top_k probabilities (renormalised to sum to 1 when `renormalize`, as
    Mixtral always and Qwen3-MoE with norm_topk_prob do). Returns (weights [num_tokens, top_k]
    float32, expert ids [num_tokens, top_k] int64). Pure torch on any device, for every backend:
    it is a few small ops next to the experts' matmuls."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    """The experts of a mixture-of-experts layer: for every token t and each of its k experts
    e = topk_ids[t, k],

        h = act(gate_up[e][:I] @ x[t]) * (gate_up[e][I:] @ x[t])
        out[t] = sum over k of topk_weights[t, k] * (down[e] @ h)

    x: [num_tokens, hidden]; gate_up: [E, 2 * I, hidden] (each expert's gate rows, then its up
    rows); down: [E, hidden, I]; all one float dtype. topk_weights: [num_tokens, top_k] float32;
    topk_ids: [num_tokens, top_k] int32 or int64 in [0, E). activation: "silu" or "gelu_tanh".
    Returns a new [num_tokens, hidden] tensor in x's dtype.

    Loops over the experts that received tokens, as transformers' MoE block does, with its
    rounding: each expert's output is rounded to the dtype, multiplied by the float32 weight
    (promoting to float32), rounded again and summed into the output in the dtype.
    """
    if validation.CHECK_ARGS:
        check_fused_moe_args(x, gate_up, down, topk_weights, topk_ids, activation)
    act_and_mul = silu_and_mul if activation == "silu" else gelu_tanh_and_mul
    out = torch.zeros_like(x)
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picks = order[start : start + count]
        start += count
        tokens = picks // topk_ids.shape[1]
        h = act_and_mul(F.linear(x.index_select(0, tokens), gate_up[expert]))
        y = F.linear(h, down[expert]) * topk_weights.flatten().index_select(0, picks)[:, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out
