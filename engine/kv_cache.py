"""KV-cache sizing and allocation.

bytes per token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes
(`ModelConfig.kv_bytes_per_token`). The number of blocks is the memory budget divided by
block_size x bytes per token; every layer gets one K and one V tensor of shape
[num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.engine_config import GiB
from engine.model_config import ModelConfig
from scheduler.utils import cdiv


def default_cpu_kv_memory() -> int:
    """A sensible CPU budget: 4 GiB (vLLM's CPU default), at most a quarter of physical RAM."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(4 * GiB, total // 4)


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    @property
    def blocks_per_seq(self) -> int:
        """Blocks one sequence of max_model_len tokens takes."""
        return cdiv(self.max_model_len, self.block_size)

    @property
    def max_concurrency(self) -> float:
        """How many sequences of max_model_len tokens fit at once."""
        return self.num_blocks / self.blocks_per_seq

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.num_tokens} tokens, "
            f"{self.bytes_per_token} bytes/token, {self.total_bytes / GiB:.2f} GiB; "
            f"max concurrency at {self.max_model_len} tokens: {self.max_concurrency:.2f}x"
        )


def gpu_kv_cache_budget(total: int, utilization: float, in_use: int, peak_activation: int) -> int:
    """Bytes left for the KV cache on a GPU of `total` bytes of which the engine may use
    `utilization`: what is already in use (weights, the CUDA context, other processes) and the
    activation peak of the largest step both come out of that share.

        budget = total x utilization - in use - activation peak
    """
    budget = int(total * utilization) - in_use - peak_activation
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:.2f} x {total / GiB:.1f} GiB = "
            f"{total * utilization / GiB:.2f} GiB allowed, {in_use / GiB:.2f} GiB already in use "
            f"(weights, CUDA context, other processes) and {peak_activation / GiB:.2f} GiB for "
            "the activations of the largest step; raise --gpu-memory-utilization or lower "
            "--max-num-batched-tokens / --max-num-seqs"
        )
    return budget


def plan_kv_cache(
    config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    max_model_len: int,
    memory_bytes: int | None = None,
    num_blocks: int | None = None,
) -> KVCachePlan:
    """Blocks for a memory budget (or an explicit block count). Raises ValueError when not even one
    sequence of max_model_len tokens would fit, saying how much memory that needs."""
    per_token = config.kv_bytes_per_token(dtype.itemsize)
    if num_blocks is None:
        budget = default_cpu_kv_memory() if memory_bytes is None else memory_bytes
        num_blocks = budget // (per_token * block_size)
    plan = KVCachePlan(num_blocks, block_size, per_token, max_model_len)
    # The scheduler relies on this: a request of max_model_len tokens must fit on its own, or it
    # could preempt everyone, itself included, and never finish.
    if num_blocks < plan.blocks_per_seq:
        need = plan.blocks_per_seq * block_size * per_token
        raise ValueError(
            f"KV cache of {num_blocks} blocks cannot hold one sequence of max_model_len="
            f"{max_model_len} tokens ({plan.blocks_per_seq} blocks, {need / 2**20:.1f} MiB); "
            "raise --kv-cache-memory or lower --max-model-len"
        )
    return plan


def kv_plan_report(
    name: str,
    config: ModelConfig,
    dtype: torch.dtype,
    num_seqs: int,
    max_model_len: int,
    block_size: int,
) -> str:
    """What `pagedserve kv-plan` prints: the bytes one token takes, worked out step by step, and
    the memory and blocks that num_seqs sequences of max_model_len tokens need."""
    L, H, D = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    s = dtype.itemsize
    per_token = config.kv_bytes_per_token(s)
    per_layer = per_token // L
    plan = KVCachePlan(
        num_seqs * cdiv(max_model_len, block_size), block_size, per_token, max_model_len
    )
    # Every sequence's last block is partly empty; the formula counts tokens, not blocks.
    total = num_seqs * max_model_len * per_token
    B, T = num_seqs, max_model_len
    return "\n".join(
        (
            f"model: {name} ({config.architecture}), {L} layers, {H} KV heads, head_dim {D}, "
            f"dtype {str(dtype).removeprefix('torch.')} ({s} bytes)",
            f"per layer per token: 2 x {H} x {D} x {s} = {per_layer} bytes (K and V)",
            f"per token: {L} layers x {per_layer} = {per_token} bytes ({per_token / 1024:.1f} KiB)",
            f"total for {B} sequences x {T} tokens: M = 2*B*L*T*H_kv*D*s = "
            f"2*{B}*{L}*{T}*{H}*{D}*{s} = {total} bytes ({total / GiB:.3f} GiB)",
            f"blocks: {plan.blocks_per_seq} per sequence of block_size {block_size}, "
            f"{plan.num_blocks} in all ({plan.total_bytes} bytes)",
        )
    )


def allocate_kv_caches(
    config: ModelConfig, plan: KVCachePlan, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Zeroed, not empty: attention reads whole blocks and masks the tail, and masked garbage that
    # happens to be NaN or inf would still poison the weighted sum.
    shape = (plan.num_blocks, plan.block_size, config.num_key_value_heads, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]
