"""Argument checks shared by every backend of the kernels, behind a debug switch.

They look only at shapes, dtypes, devices and strides, never at tensor values, so they never
synchronise with the device. Each failure is a ValueError that names the argument and says what
was expected.

They run only when PAGEDSERVE_CHECK_KERNEL_ARGS=1 (read once, at import): an eager step calls
the ops several times per layer, and the engine's own calls are right by construction. The tests
turn them on (tests/conftest.py); turn them on when writing a new caller.

fp8 caches (`kernels.fp8`): q, key, value and qkv may be any float dtype other than fp8 when the
cache is fp8 (otherwise they must match the cache's dtype). The scales k_scale / v_scale must be
float32 tensors of shape [1] on the cache's device, and are refused for a cache that is not fp8:
there they would be ignored, and a caller passing them believes its cache is fp8.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from pagedserve.kernels.fp8 import is_fp8

CHECK_ARGS_ENV = "PAGEDSERVE_CHECK_KERNEL_ARGS"
CHECK_ARGS: bool = os.environ.get(CHECK_ARGS_ENV, "0") == "1"


def _check_same_device(**tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listed}")


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} differs from "
            f"k_cache shape {tuple(k_cache.shape)}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}"
        )
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        # Slots are addressed as block_id * block_size + offset over the first two dims merged.
        if cache.shape[0] > 1 and cache.stride(0) != cache.shape[1] * cache.stride(1):
            raise ValueError(
                f"{name} must have its block and offset dims contiguous with each other "
                f"(stride {cache.stride()} for shape {tuple(cache.shape)})"
            )


def _check_kv_dtype(name: str, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """`name` (q, key, value, qkv) against the cache: the same dtype, or for an fp8 cache any
    float dtype that is not fp8."""
    if is_fp8(cache_dtype):
        if not dtype.is_floating_point or is_fp8(dtype):
            raise ValueError(
                f"{name} must be float32, bfloat16 or float16 with an fp8 cache "
                f"({cache_dtype}), got {dtype}"
            )
    elif dtype != cache_dtype:
        raise ValueError(f"{name} dtype {dtype} differs from the cache dtype {cache_dtype}")


def check_kv_scales(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """Raise ValueError unless each scale is None, or a float32 [1] tensor on the cache's device
    with an fp8 cache."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        if not is_fp8(k_cache.dtype):
            raise ValueError(
                f"{name} is given but the cache is {k_cache.dtype}: scales apply to fp8 caches "
                "only; pass None"
            )
        if not isinstance(scale, torch.Tensor):
            raise ValueError(
                f"{name} must be a float32 tensor of shape [1] (read by the kernels at every "
                f"call), got {type(scale).__name__}"
            )
        if scale.dtype != torch.float32 or scale.shape != (1,):
            raise ValueError(
                f"{name} must be a float32 tensor of shape [1], got {scale.dtype} "
                f"{tuple(scale.shape)}"
            )
        if scale.device != k_cache.device:
            raise ValueError(f"{name} is on {scale.device}, but the cache is on {k_cache.device}")


def _check_index(name: str, t: torch.Tensor, dim: int, dtype: torch.dtype) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")


def check_reshape_and_cache_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Raise ValueError unless the arguments fit `reshape_and_cache`'s signature."""
    if key.dim() != 3:
        raise ValueError(
            f"key must be [num_tokens, num_kv_heads, head_dim], got shape {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(
            f"value shape {tuple(value.shape)} differs from key shape {tuple(key.shape)}"
        )
    _check_cache_pair(k_cache, v_cache)
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key has {key.shape[1]} kv heads of dim {key.shape[2]}, but k_cache holds "
            f"{k_cache.shape[2]} kv heads of dim {k_cache.shape[3]}"
        )
    if is_fp8(k_cache.dtype):
        if value.dtype != key.dtype:
            raise ValueError(f"value dtype {value.dtype} differs from key dtype {key.dtype}")
        _check_kv_dtype("key", key.dtype, k_cache.dtype)
    elif key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise ValueError(
            f"key/value dtypes ({key.dtype}, {value.dtype}) must match the cache dtype "
            f"{k_cache.dtype}"
        )
    check_kv_scales(k_cache, k_scale, v_scale)
    _check_index("slot_mapping", slot_mapping, 1, torch.int64)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens"
        )
    _check_same_device(
        key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping
    )


def check_copy_blocks_args(
    caches: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor
) -> None:
    if not caches:
        raise ValueError("copy_blocks needs at least one cache")
    first = caches[0]
    for i, cache in enumerate(caches):
        if cache.shape != first.shape or cache.dtype != first.dtype:
            raise ValueError(
                f"caches[{i}] is {tuple(cache.shape)} {cache.dtype}, but caches[0] is "
                f"{tuple(first.shape)} {first.dtype}: every cache must be alike"
            )
        if not cache.is_contiguous():
            raise ValueError(f"caches[{i}] must be contiguous (stride {cache.stride()})")
    _check_index("src", src, 1, torch.int64)
    _check_index("dst", dst, 1, torch.int64)
    if src.shape != dst.shape:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} differ in length")
    _check_same_device(caches=first, src=src, dst=dst)


def check_paged_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor | None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Raise ValueError unless the arguments fit `paged_attention`'s signature."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    _check_cache_pair(k_cache, v_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"q has head_dim {head_dim}, but k_cache has head_dim {k_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"q has {num_heads} heads, not a multiple of k_cache's {num_kv_heads} kv heads"
        )
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    _check_kv_dtype("q", q.dtype, k_cache.dtype)
    check_kv_scales(k_cache, k_scale, v_scale)
    _check_index("block_tables", block_tables, 2, torch.int32)
    _check_index("seq_lens", seq_lens, 1, torch.int32)
    _check_index("query_start_loc", query_start_loc, 1, torch.int32)
    num_seqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"seq_lens has {seq_lens.shape[0]} entries but block_tables has {num_seqs} rows"
        )
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
            f"got {query_start_loc.shape[0]}"
        )
    if not isinstance(scale, int | float) or isinstance(scale, bool):
        raise ValueError(f"scale must be a Python float, got {type(scale).__name__}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int)
        or isinstance(sliding_window, bool)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    if softcap is not None and (
        not isinstance(softcap, int | float) or isinstance(softcap, bool) or not softcap > 0
    ):
        raise ValueError(f"softcap must be None or a positive float, got {softcap!r}")
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(
                f"out must be {tuple(q.shape)} {q.dtype} like q, got {tuple(out.shape)} {out.dtype}"
            )
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    _check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        out=out,
    )


# ----------------------------------------------------------------------------- fused layer ops
# The same kind of checks for the decoder's non-attention ops (`kernels.reference.rms_norm`,
# `fused_add_rms_norm`, `silu_and_mul`, `rotary_and_cache` and their Triton twins). Row tensors
# must be contiguous along their last dim in both backends, so the two accept the same inputs.


def _check_rows(name: str, t: torch.Tensor, layout: str) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dim, got strides {t.stride()}")


def _check_norm_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    hidden = x.shape[1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}] like x's last dim, got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(
            f"weight dtype {weight.dtype} differs from x dtype {x.dtype} (the weight multiplies "
            "in x's dtype)"
        )
    if hidden > 1 and weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous, got stride {weight.stride()}")
    if not isinstance(eps, int | float) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative Python float, got {eps!r}")


def check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Raise ValueError unless the arguments fit `rms_norm`'s signature."""
    _check_rows("x", x, "[num_tokens, hidden_size]")
    _check_norm_weight(x, weight, eps)
    _check_same_device(x=x, weight=weight)


def check_fused_add_rms_norm_args(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """Raise ValueError unless the arguments fit `fused_add_rms_norm`'s signature."""
    _check_rows("x", x, "[num_tokens, hidden_size]")
    _check_rows("residual", residual, "[num_tokens, hidden_size]")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must be {tuple(x.shape)} {x.dtype} like x, "
            f"got {tuple(residual.shape)} {residual.dtype}"
        )
    _check_norm_weight(x, weight, eps)
    _check_same_device(x=x, residual=residual, weight=weight)


def check_silu_and_mul_args(gate_up: torch.Tensor) -> None:
    """Raise ValueError unless the argument fits `silu_and_mul`'s signature."""
    _check_rows("gate_up", gate_up, "[num_tokens, 2 * intermediate_size]")
    if gate_up.shape[1] % 2:
        raise ValueError(
            f"gate_up must hold gate and up side by side (an even last dim), "
            f"got shape {tuple(gate_up.shape)}"
        )


def check_rotary_and_cache_args(
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Raise ValueError unless the arguments fit `rotary_and_cache`'s signature."""
    for name, value in (
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (rotary pairs dims i and i + D/2), got {head_dim}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    _check_rows("qkv", qkv, f"[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim = {width}]")
    if qkv.shape[1] != width:
        raise ValueError(
            f"qkv has {qkv.shape[1]} columns, but {num_heads} q heads + 2 x {num_kv_heads} kv "
            f"heads of dim {head_dim} need {width}"
        )
    num_tokens = qkv.shape[0]
    _check_index("positions", positions, 1, torch.int64)
    _check_index("slot_mapping", slot_mapping, 1, torch.int64)
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape[0] != num_tokens:
            raise ValueError(f"{name} has {t.shape[0]} entries for {num_tokens} tokens")
    for name, table in (("cos_table", cos_table), ("sin_table", sin_table)):
        if table.dim() != 2 or table.shape[1] != head_dim:
            raise ValueError(
                f"{name} must be [max_positions, head_dim = {head_dim}], "
                f"got shape {tuple(table.shape)}"
            )
        if table.dtype != torch.float32:
            raise ValueError(f"{name} must be torch.float32, got {table.dtype}")
        if table.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim, got {table.stride()}")
    if sin_table.shape != cos_table.shape:
        raise ValueError(
            f"sin_table shape {tuple(sin_table.shape)} differs from "
            f"cos_table shape {tuple(cos_table.shape)}"
        )
    _check_cache_pair(k_cache, v_cache)
    if k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"k_cache holds {k_cache.shape[2]} kv heads of dim {k_cache.shape[3]}, "
            f"expected {num_kv_heads} of dim {head_dim}"
        )
    _check_kv_dtype("qkv", qkv.dtype, k_cache.dtype)
    check_kv_scales(k_cache, k_scale, v_scale)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(3) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim, got {cache.stride()}")
    _check_same_device(
        qkv=qkv,
        positions=positions,
        cos_table=cos_table,
        sin_table=sin_table,
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=slot_mapping,
    )


def check_fused_moe_args(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
) -> None:
    """Raise ValueError unless the arguments fit `fused_moe`'s signature."""
    _check_rows("x", x, "[num_tokens, hidden]")
    num_tokens, hidden = x.shape
    if gate_up.dim() != 3 or gate_up.shape[2] != hidden or gate_up.shape[1] % 2:
        raise ValueError(
            f"gate_up must be [num_experts, 2 * intermediate, {hidden}], got {tuple(gate_up.shape)}"
        )
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if down.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"down must be [{num_experts}, {hidden}, {inter}] to match gate_up, "
            f"got {tuple(down.shape)}"
        )
    for name, t in (("gate_up", gate_up), ("down", down)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from x dtype {x.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if topk_weights.dim() != 2 or topk_weights.shape[0] != num_tokens:
        raise ValueError(
            f"topk_weights must be [{num_tokens}, top_k], got {tuple(topk_weights.shape)}"
        )
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"topk_ids must be {tuple(topk_weights.shape)} like topk_weights, "
            f"got {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {activation!r}")
    _check_same_device(
        x=x, gate_up=gate_up, down=down, topk_weights=topk_weights, topk_ids=topk_ids
    )
