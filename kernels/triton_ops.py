"""The Triton backend as one module: the attention kernels of `kernels.triton_attention`, the
fused layer ops of `kernels.triton_fused` and the experts of `kernels.triton_moe`, under the names
and signatures of `kernels.reference` (the torch backend; its `moe_route`, a few small torch ops,
serves both). `kernels.get_backend("triton")` returns this module."""

from pagedserve.kernels.reference import moe_route
from pagedserve.kernels.triton_attention import (
    INTERPRETED,
    check_runnable,
    copy_blocks,
    paged_attention,
    reshape_and_cache,
)
from pagedserve.kernels.triton_fused import (
    fused_add_rms_norm,
    gelu_tanh_and_mul,
    rms_norm,
    rotary_and_cache,
    silu_and_mul,
)
from pagedserve.kernels.triton_moe import fused_moe

__all__ = [
    "INTERPRETED",
    "check_runnable",
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
