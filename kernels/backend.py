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

import torch


class KernelBackend(Protocol):
    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        out: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None: ...

    def copy_blocks(
        self, caches: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor
    ) -> None: ...

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False
    ) -> torch.Tensor: ...

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        unit_offset: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rotary_and_cache(
        self,
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
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def moe_route(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def fused_moe(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        activation: str = "silu",
    ) -> torch.Tensor: ...


# The ops, in the Protocol's order.
OPS = tuple(name for name in KernelBackend.__dict__ if not name.startswith("_"))
