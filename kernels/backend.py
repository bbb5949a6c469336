"""The contract every kernel backend keeps: the ops the model calls between its matmuls, with one
signature each. `kernels.reference` (torch), `kernels.cpu_ops` (compiled C++ where it helps, the
reference elsewhere) and `kernels.triton_ops` implement it as modules; `kernels.get_backend`
returns one, typed as this Protocol, and `kernels.<op>` dispatches by device.
tests/kernels/test_backend.py checks that each backend's signatures are these.

What each op computes is documented, and defined, by the reference (`kernels/reference.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor


# One op per line or two, so the contract reads at a glance (the backends spell each out).
class KernelBackend(Protocol):
    def paged_attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
        query_start_loc: Tensor, scale: float, *, sliding_window: int | None = None,
        softcap: float | None = None, out: Tensor | None = None, k_scale: Tensor | None = None,
        v_scale: Tensor | None = None,
    ) -> Tensor: ...  # fmt: skip

    def reshape_and_cache(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
        *, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
    ) -> None: ...  # fmt: skip

    def copy_blocks(self, caches: Sequence[Tensor], src: Tensor, dst: Tensor) -> None: ...

    def rms_norm(
        self, x: Tensor, weight: Tensor, eps: float, *, unit_offset: bool = False
    ) -> Tensor: ...  # fmt: skip

    def fused_add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float, *, unit_offset: bool = False
    ) -> tuple[Tensor, Tensor]: ...  # fmt: skip

    def silu_and_mul(self, gate_up: Tensor) -> Tensor: ...

    def gelu_tanh_and_mul(self, gate_up: Tensor) -> Tensor: ...

    def rotary_and_cache(
        self, qkv: Tensor, positions: Tensor, cos_table: Tensor, sin_table: Tensor, k_cache: Tensor,
        v_cache: Tensor, slot_mapping: Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
        *, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
    ) -> Tensor: ...  # fmt: skip

    def moe_route(
        self, router_logits: Tensor, top_k: int, renormalize: bool
    ) -> tuple[Tensor, Tensor]: ...  # fmt: skip

    def fused_moe(
        self, x: Tensor, gate_up: Tensor, down: Tensor, topk_weights: Tensor, topk_ids: Tensor, *,
        activation: str = "silu",
    ) -> Tensor: ...  # fmt: skip


# The ops, in the Protocol's order.
OPS = tuple(name for name in KernelBackend.__dict__ if not name.startswith("_"))
