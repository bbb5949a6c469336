"""The model's kernels behind one backend switch (re-exported by `pagedserve.kernels`).

`paged_attention`, `reshape_and_cache`, `copy_blocks`, the fused layer ops (`rms_norm`,
`fused_add_rms_norm`, `silu_and_mul`, `gelu_tanh_and_mul`, `rotary_and_cache`) and the
mixture-of-experts ops (`moe_route`, `fused_moe`) route each call to a backend module with the
same signatures, those of the `KernelBackend` contract (kernels/backend.py):

    cpu     `kernels.cpu_ops`: paged attention compiled from C++ for this machine's CPU (built
            once and cached), the other ops from the reference; the default for CPU tensors
            when it builds (a machine without a C++ compiler falls back to torch, warning once)
    torch   `kernels.reference`, pure torch, any device; the oracle the others are tested against
    triton  `kernels.triton_ops` (the kernels of `kernels.triton_attention` and
            `kernels.triton_fused`); the default for CUDA tensors. On CPU
            tensors they run only under Triton's interpreter (TRITON_INTERPRET=1, set before
            the module is first imported).

The cache ops take keyword-only k_scale / v_scale for an fp8 KV cache; the fp8 facts (the
dtypes by name, `is_fp8`, `quantize_kv` / `dequantize_kv`, `kv_scale_from_amax`) live in
`kernels.fp8` and are exported here.

The environment variable PAGEDSERVE_ATTENTION_BACKEND forces one by name; it is read per call, so
tests can set it with monkeypatch and no module state changes. The engine resolves its backend
once (`resolve_backend`) and calls the module directly. The Triton module is imported on first
use, so CPU-only runs never import Triton; the CPU kernel is built or loaded on first use.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, cast

import torch

# cpu_features first: with PAGEDSERVE_CPU_ISA set it tells torch and oneDNN to act as that lesser
# CPU, which only holds if it runs before torch's first op (importing torch computes nothing).
from pagedserve.kernels import cpu_features, reference  # noqa: F401
from pagedserve.kernels.backend import OPS, KernelBackend
from pagedserve.kernels.fp8 import (
    FP8_KV_DTYPES,
    MIN_KV_SCALE,
    dequantize_kv,
    is_fp8,
    kv_scale_from_amax,
    quantize_kv,
)

__all__ = [
    "BACKENDS",
    "OPS",
    "KernelBackend",
    "BACKEND_ENV",
    "FP8_KV_DTYPES",
    "MIN_KV_SCALE",
    "copy_blocks",
    "dequantize_kv",
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_tanh_and_mul",
    "get_backend",
    "is_fp8",
    "kv_scale_from_amax",
    "lora_add",
    "moe_route",
    "paged_attention",
    "quantize_kv",
    "reference",
    "reshape_and_cache",
    "resolve_backend",
    "rms_norm",
    "rotary_and_cache",
    "select_backend",
    "silu_and_mul",
]

BACKEND_ENV = "PAGEDSERVE_ATTENTION_BACKEND"
BACKENDS = ("cpu", "torch", "triton")


def select_backend(device: torch.device) -> str:
    """Name of the backend used for tensors on `device`: $PAGEDSERVE_ATTENTION_BACKEND, or the
    device's default (triton on CUDA, cpu on CPU where its kernel builds, torch elsewhere)."""
    return resolve_backend("auto", device)


def resolve_backend(name: str, device: torch.device) -> str:
    """`name` when it is a backend; for "auto", $PAGEDSERVE_ATTENTION_BACKEND or the device's
    default. Raises ValueError for anything else, and for cpu on a device that is not the CPU."""
    source = "attention backend"
    if name == "auto":
        name = os.environ.get(BACKEND_ENV, "").strip().lower()
        source = BACKEND_ENV
        if not name:
            if device.type == "cuda":
                return "triton"
            if device.type == "cpu":
                from pagedserve.kernels import cpu_ops

                return "cpu" if cpu_ops.available() else "torch"
            return "torch"
    if name not in BACKENDS:
        raise ValueError(
            f"{source}={name!r} is not an attention backend; choose one of: " + ", ".join(BACKENDS)
        )
    if name == "cpu" and device.type != "cpu":
        raise ValueError(
            f"{source}=cpu runs on CPU tensors only, not on {device.type}; choose triton or torch"
        )
    return name


def get_backend(name: str) -> KernelBackend:
    """The module implementing backend `name` (imported on first use): a module that keeps the
    `KernelBackend` contract (kernels/backend.py)."""
    if name == "torch":
        return cast(KernelBackend, reference)
    if name == "cpu":
        from pagedserve.kernels import cpu_ops

        return cast(KernelBackend, cpu_ops)
    if name == "triton":
        from pagedserve.kernels import triton_ops

        return cast(KernelBackend, triton_ops)
    raise ValueError(f"{name!r} is not an attention backend; choose one of: " + ", ".join(BACKENDS))


def _dispatcher(name: str) -> Callable[..., Any]:
    """`kernels.<name>`: the op of the backend for the device of its first argument (a tensor in
    every op), with `kernels.reference.<name>`'s signature and documentation."""
    reference_op = getattr(reference, name)

    @functools.wraps(reference_op)
    def op(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()))
        if isinstance(first, (list, tuple)):  # copy_blocks: the caches
            first = first[0]
        return getattr(get_backend(select_backend(first.device)), name)(*args, **kwargs)

    return op


paged_attention = _dispatcher("paged_attention")
reshape_and_cache = _dispatcher("reshape_and_cache")
copy_blocks = _dispatcher("copy_blocks")
rms_norm = _dispatcher("rms_norm")
fused_add_rms_norm = _dispatcher("fused_add_rms_norm")
silu_and_mul = _dispatcher("silu_and_mul")
gelu_tanh_and_mul = _dispatcher("gelu_tanh_and_mul")
moe_route = _dispatcher("moe_route")
fused_moe = _dispatcher("fused_moe")
rotary_and_cache = _dispatcher("rotary_and_cache")


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    a_slots: torch.Tensor,
    b_slots: torch.Tensor,
    part_sizes: tuple[int, ...],
    *,
    token_slots: torch.Tensor | None = None,
    groups: list | None = None,
) -> None:
    """Add each token's LoRA delta into `y` in place (engine/lora/layers.py): on CUDA the Triton
    shrink and expand of `kernels.triton_lora`, which read `token_slots` on the device (so a
    captured CUDA graph replays them with any adapters); on CPU the grouped matmuls of
    `kernels.lora` over `groups` (the step's tokens by slot, built once on the host). The CPU's
    masked path for few tokens (`kernels.lora.lora_add_cpu_dense`) is called directly, with
    the engine's packed weights."""
    if y.is_cuda:
        from pagedserve.kernels import triton_lora

        triton_lora.lora_add_triton(y, x, token_slots, a_slots, b_slots, part_sizes)
    elif groups:
        from pagedserve.kernels import lora

        lora.lora_add_cpu(y, x, groups, a_slots, b_slots, part_sizes)
