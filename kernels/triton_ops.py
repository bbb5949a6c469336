"""The Triton backend as one module: the attention kernels of `kernels.triton_attention` and the
fused layer ops of `kernels.triton_fused`, under the names and signatures of `kernels.reference`
(the torch backend). `kernels.get_backend("triton")` returns this module."""

from kernels.triton_attention import (
    INTERPRETED,
    check_runnable,
    copy_blocks,
    paged_attention,
    reshape_and_cache,
)
from kernels.triton_fused import fused_add_rms_norm, rms_norm, rotary_and_cache, silu_and_mul

__all__ = [
    "INTERPRETED",
    "check_runnable",
    "copy_blocks",
    "fused_add_rms_norm",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_and_cache",
    "silu_and_mul",
]
