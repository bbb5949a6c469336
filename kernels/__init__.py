"""Attention kernels behind one backend switch.

`paged_attention` and `reshape_and_cache` route each call to a backend module with the same
signatures. Today the only backend is `kernels.reference` (pure torch, any device). The
environment variable PAGEDSERVE_ATTENTION_BACKEND picks one by name; it is read per call, so
tests can set it with monkeypatch and no module state changes.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from kernels import reference

__all__ = ["BACKEND_ENV", "paged_attention", "reference", "reshape_and_cache", "select_backend"]

BACKEND_ENV = "PAGEDSERVE_ATTENTION_BACKEND"

_BACKENDS: dict[str, ModuleType] = {"torch": reference}
# The Triton kernels register here as "triton", and become the default for CUDA tensors.


def select_backend(device: torch.device) -> str:
    """Name of the backend used for tensors on `device`: $PAGEDSERVE_ATTENTION_BACKEND, or the
    device's default."""
    name = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not name:
        return "torch"
    if name not in _BACKENDS:
        raise ValueError(
            f"{BACKEND_ENV}={name!r} is not an attention backend; choose one of: "
            + ", ".join(sorted(_BACKENDS))
        )
    return name


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V into its cache slot; see `kernels.reference.reshape_and_cache`."""
    backend = _BACKENDS[select_backend(key.device)]
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
    backend = _BACKENDS[select_backend(q.device)]
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
