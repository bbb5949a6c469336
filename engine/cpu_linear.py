"""Linear layers with weights pre-packed for oneDNN, for bfloat16 and float32 on CPU.

`F.linear` in bf16 on CPU reorders the weight into oneDNN's blocked layout on every call; for
the small row counts of decode steps that reorder costs as much as the matmul, so the weights
are packed once at load time (measured: BENCHMARKS.md, "What changed on the way"). In float32,
oneDNN's packed kernels run a decode step's matmuls 2-4x faster than `F.linear`'s (BENCHMARKS.md,
"CPU attention kernel"); they accumulate in another order, a few ulps apart, and the parity
tests' greedy tokens still equal transformers'. The packed copy lives next to the parameter (as
an attribute), so the plain weight stays usable for embeddings and references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.quantized_linear import quantized

_PACKED = "_pagedserve_onednn_packed"
PACKED_DTYPES = (torch.bfloat16, torch.float32)


# /proc/cpuinfo flags of CPUs that compute bf16 in hardware (dot products, AMX tiles).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_computes_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively (`NATIVE_BF16_FLAGS`): then bf16 is faster than
    float32 (BENCHMARKS.md); elsewhere oneDNN emulates it and float32 is the better default.
    `cpuinfo`: the text of /proc/cpuinfo (read when None; no file: False)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """True where packing applies: float32 on a CPU with oneDNN, bf16 where its oneDNN build has
    bf16 kernels."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES:
        return False
    if dtype == torch.float32:
        return torch.backends.mkldnn.is_available()
    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack(weight: nn.Parameter) -> None:
    """Attach a oneDNN-packed copy of a [out, in] bf16 or float32 weight; `linear` then uses it
    for inputs of the weight's dtype."""
    if weight.dim() != 2 or weight.dtype not in PACKED_DTYPES or weight.device.type != "cpu":
        raise ValueError(
            f"only 2-D bfloat16 or float32 CPU weights can be packed, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    setattr(weight, _PACKED, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))


def unpack(weight: torch.Tensor) -> None:
    """Drop the packed copy: `linear` goes back to plain F.linear for this weight."""
    if hasattr(weight, _PACKED):
        delattr(weight, _PACKED)


def is_packed(weight: torch.Tensor) -> bool:
    return getattr(weight, _PACKED, None) is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the weight kept quantized (engine/quantized_linear.py)
    or the packed weight when there is one."""
    kept = quantized(weight)
    if kept is not None:
        return kept.linear(x, bias)
    packed = getattr(weight, _PACKED, None)
    if packed is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
