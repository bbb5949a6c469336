"""Linear layers with weights pre-packed for oneDNN, for bfloat16 and float32 on CPU.

`F.linear` in bf16 on CPU reorders the weight into oneDNN's blocked layout on every call; for the
small row counts of decode steps that reorder costs as much as the matmul, so the weights are packed
once at load time (measured: docs/benchmarks-history.md, "What changed on the way"). In float32,
oneDNN's packed kernels run a decode step's matmuls 2-4x faster than `F.linear`'s
(docs/benchmarks-history.md, "CPU attention kernel"); they accumulate in another order, a few ulps
apart, and the parity tests' greedy tokens still equal transformers'. The packed copy lives next to
the parameter (as an attribute), so the plain weight stays usable for embeddings and references.
bf16 weights are packed only where oneDNN has bf16 kernels for the CPU (`kernels/cpu_features.py`
`onednn_bf16`; not on AVX2-only CPUs, where its reorder raises): elsewhere they stay plain, for
F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.models.quantized_linear import quantized
from pagedserve.kernels import cpu_features

_PACKED = "_pagedserve_onednn_packed"
PACKED_DTYPES = (torch.bfloat16, torch.float32)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """True where packing applies: float32 on a CPU with oneDNN, bf16 where the CPU (and the level
    pagedserve decides by) lets oneDNN pack it (`kernels/cpu_features.py` `onednn_bf16`: its
    reorder raises on CPUs without avx512bw/vl/dq or avx_ne_convert, AVX2-only ones)."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES:
        return False
    if dtype == torch.float32:
        return torch.backends.mkldnn.is_available()
    return cpu_features.onednn_bf16()


def pack(weight: nn.Parameter) -> bool:
    """Attach a oneDNN-packed copy of a [out, in] bf16 or float32 weight where this CPU can
    (`can_pack`); `linear` then uses it for inputs of the weight's dtype, and F.linear where it
    is not packed. Whether it packed."""
    if weight.dim() != 2 or weight.dtype not in PACKED_DTYPES or weight.device.type != "cpu":
        raise ValueError(
            f"only 2-D bfloat16 or float32 CPU weights can be packed, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    if not can_pack(weight.device, weight.dtype):
        return False
    setattr(weight, _PACKED, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
    return True


def unpack(weight: torch.Tensor) -> None:
    """Drop the packed copy: `linear` goes back to plain F.linear for this weight."""
    if hasattr(weight, _PACKED):
        delattr(weight, _PACKED)


def is_packed(weight: torch.Tensor) -> bool:
    return getattr(weight, _PACKED, None) is not None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    float_out: bool = False,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the weight kept quantized
    (engine/models/quantized_linear.py) or the packed weight when there is one. `float_out`: a
    kept weight may give float32 whatever x's dtype (others give x's dtype)."""
    kept = quantized(weight)
    if kept is not None:
        return kept.linear(x, bias, float_out)
    if x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu":
        # oneDNN multiplies one row by another kernel than it does two or more, whose sums come
        # out a few ulps apart (tests/kernels/test_batch_invariance.py): a lone row goes through
        # as two, so that it gets the bits it gets in a step of any rows.
        if not cpu_features.batch_variant():
            return linear(x.expand(2, -1).contiguous(), weight, bias, float_out)[:1]
    packed = getattr(weight, _PACKED, None)
    if packed is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
