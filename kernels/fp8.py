"""The fp8 KV cache: its dtypes, how values go into it and come back out, and a scale from data.

One place for these facts; both backends (`kernels.reference`, `kernels.triton_ops`), the
validation and the engine read them from here (re-exported by `kernels`).

A KV cache of dtype float8_e4m3fn or float8_e5m2 holds each key/value element as

    write   c = (x.float() / scale).clamp(-finfo.max, finfo.max).to(cache_dtype)
    read    x' = (c.float() * scale).to(q.dtype)

where `scale` (one per cache, for K and for V) is a float32 tensor of shape [1] on the cache's
device, or None for 1.0. The clamp makes the write saturate: torch's cast of an out-of-range
value is not saturating on every device (float8_e4m3fn has no infinity, so a cast may give NaN;
float8_e5m2 overflows to inf). The kernels read the scale from memory at every call, never as a
launch-time constant: the engine calibrates it in place, after CUDA graphs may have captured the
kernels. The read rounds to q's dtype before the products with q and the probabilities, so the
attention math is q's, on the dequantized values.

q, key, value and qkv stay float32, bfloat16 or float16; only the cache is fp8 (one byte per
element, half of bf16's bytes to read in decode). e4m3 keeps 3 mantissa bits (relative rounding
error up to 2^-4) over magnitudes up to 448; e5m2 keeps 2 bits (2^-3) up to 57344.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

__all__ = [
    "FP8_KV_DTYPES",
    "MIN_KV_SCALE",
    "dequantize_kv",
    "fp8_max",
    "is_fp8",
    "kv_scale_from_amax",
    "quantize_kv",
]

# The engine's --kv-cache-dtype names for the fp8 caches ("fp8" is e4m3, as in vLLM).
FP8_KV_DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType(
    {
        "fp8": torch.float8_e4m3fn,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }
)
_FP8_DTYPES = frozenset(FP8_KV_DTYPES.values())

# The smallest scale `kv_scale_from_amax` returns: an all-zero calibration (amax 0) must not give
# scale 0 (x / 0). float32's smallest normal keeps x / scale finite for |x| < 2^-1 and saturates
# the rest, so a cache calibrated on zeros still reads back finite values.
MIN_KV_SCALE = torch.finfo(torch.float32).tiny
# Headroom of `kv_scale_from_amax`: the calibrated amax lands at half the format's range, so later
# tokens up to twice as large still fit.
_AMAX_HEADROOM = 2.0


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the fp8 cache dtypes (float8_e4m3fn, float8_e5m2)."""
    return dtype in _FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of fp8 `dtype` (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in fp8 `dtype`, saturated to the format's range (round to nearest even)."""
    y = x.float() if scale is None else x.float() / scale
    limit = fp8_max(dtype)
    return y.clamp(-limit, limit).to(dtype)  # not clamp_: x.float() may be x itself


def dequantize_kv(c: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """fp8 values `c` times scale, rounded to `dtype` (the dtype of q)."""
    y = c.float()
    return (y if scale is None else y * scale).to(dtype)


def kv_scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale that maps magnitude `amax` to half of fp8 `dtype`'s range: amax * 2 / finfo.max,
    at least MIN_KV_SCALE. `amax` is a one-element tensor (e.g. k.abs().amax() over a calibration
    batch); the result is a float32 [1] tensor on its device, ready to copy_ into the engine's
    scale tensor. No host sync."""
    if amax.numel() != 1:
        raise ValueError(f"amax must hold one value, got shape {tuple(amax.shape)}")
    scale = amax.detach().float().reshape(1) * (_AMAX_HEADROOM / fp8_max(dtype))
    return scale.clamp_(min=MIN_KV_SCALE)
