"""The model's kernels behind one backend switch.

`paged_attention`, `reshape_and_cache` and the fused layer ops (`rms_norm`, `fused_add_rms_norm`,
`silu_and_mul`, `rotary_and_cache`) route each call to a backend module with the same
signatures:

    torch   `kernels.reference`, pure torch, any device; the default for CPU tensors
    triton  `kernels.triton_ops` (the kernels of `kernels.triton_attention` and
            `kernels.triton_fused`); the default for CUDA tensors. On CPU
            tensors they run only under Triton's interpreter (TRITON_INTERPRET=1, set before
            the module is first imported).

The environment variable PAGEDSERVE_ATTENTION_BACKEND forces one by name; it is read per call, so
tests can set it with monkeypatch and no module state changes. The engine resolves its backend
once (`resolve_backend`) and calls the module directly. The Triton module is imported on first
use, so CPU-only runs never import Triton.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from kernels import reference

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "fused_add_rms_norm",
    "get_backend",
    "paged_attention",
    "reference",
    "reshape_and_cache",
    "resolve_backend",
    "rms_norm",
    "rotary_and_cache",
    "select_backend",
    "silu_and_mul",
]

BACKEND_ENV = "PAGEDSERVE_ATTENTION_BACKEND"
BACKENDS = ("torch", "triton")


def select_backend(device: torch.device) -> str:
    """Name of the backend used for tensors on `device`: $PAGEDSERVE_ATTENTION_BACKEND, or the
    device's default (triton on CUDA, torch elsewhere)."""
    return resolve_backend("auto", device)


def resolve_backend(name: str, device: torch.device) -> str:
    """`name` when it is a backend; for "auto", $PAGEDSERVE_ATTENTION_BACKEND or the device's
    default. Raises ValueError for anything else."""
    source = "attention backend"
    if name == "auto":
        name = os.environ.get(BACKEND_ENV, "").strip().lower()
        source = BACKEND_ENV
        if not name:
            return "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(
            f"{source}={name!r} is not an attention backend; choose one of: " + ", ".join(BACKENDS)
        )
    return name


def get_backend(name: str) -> ModuleType:
    """The module implementing backend `name` (imported on first use)."""
    if name == "torch":
        return reference
    if name == "triton":
        from kernels import triton_ops

        return triton_ops
    raise ValueError(f"{name!r} is not an attention backend; choose one of: " + ", ".join(BACKENDS))


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V into its cache slot; see `kernels.reference.reshape_and_cache`."""
    backend = get_backend(select_backend(key.device))
    backend.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over the paged KV cache; see `kernels.reference.paged_attention`."""
    backend = get_backend(select_backend(q.device))
    return backend.paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window=sliding_window,
        out=out,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm; see `kernels.reference.rms_norm`."""
    return get_backend(select_backend(x.device)).rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then RMSNorm; see `kernels.reference.fused_add_rms_norm`."""
    return get_backend(select_backend(x.device)).fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; see `kernels.reference.silu_and_mul`."""
    return get_backend(select_backend(gate_up.device)).silu_and_mul(gate_up)


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
) -> torch.Tensor:
    """Rotary q/k and the K/V-cache write; see `kernels.reference.rotary_and_cache`."""
    return get_backend(select_backend(qkv.device)).rotary_and_cache(
        qkv, positions, cos_table, sin_table, k_cache, v_cache, slot_mapping,
        num_heads, num_kv_heads, head_dim,
    )  # fmt: skip
