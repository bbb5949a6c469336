"""KV-cache sizing and allocation.

A model's layers form KV-cache groups (scheduler/kv_groups.py): one group of every layer for a
model whose layers all attend alike, else groups of k layers of one kind (full attention, or
one sliding window). One block id holds k layers' pages of block_size tokens:

    bytes per block = 2 (K and V) x k x kv_heads x head_dim x dtype bytes x block_size

and the number of blocks is the memory budget divided by that. A request holds, per group, every
block of its tokens (full attention) or those of its window and the chunk being computed
(sliding). There are k K tensors and k V tensors of shape [num_blocks, block_size, num_kv_heads,
head_dim]; the layer at position j of its group uses pair j.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.options import GiB
from pagedserve.scheduler.kv_groups import (
    KVCacheGroup,
    blocks_per_request,
    layers_per_block,
)
from pagedserve.scheduler.utils import cdiv


def default_cpu_kv_memory() -> int:
    """A sensible CPU budget: 4 GiB (vLLM's CPU default), at most a quarter of physical RAM."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(4 * GiB, total // 4)


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int  # every layer page a block id holds (K and V)
    max_model_len: int
    groups: tuple[KVCacheGroup, ...]
    # The most tokens one step computes for a request: a sliding group holds its window plus
    # that many.
    max_chunk: int
    dtype: torch.dtype | None = None  # the cache's element type, for describe()
    # An encoder-decoder's cross-attention blocks per request (scheduler/config.py).
    encoder_blocks: int = 0

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window (None: full attention), as the scheduler takes them."""
        return tuple(group.window for group in self.groups)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def blocks_per_seq(self) -> int:
        """Blocks one sequence of max_model_len tokens holds at most, across groups (and its
        encoder blocks)."""
        return self.encoder_blocks + blocks_per_request(
            self.windows, self.max_model_len, self.block_size, self.max_chunk
        )

    @property
    def max_concurrency(self) -> float:
        """How many sequences of max_model_len tokens fit at once."""
        return self.num_blocks / self.blocks_per_seq

    def describe(self) -> str:
        layout = ""
        if len(self.groups) > 1:
            kinds = ", ".join(
                f"{'full' if g.window is None else f'window {g.window}'} x {len(g.layers)}"
                for g in self.groups
            )
            layout = f" in {len(self.groups)} layer groups ({kinds})"
        if self.encoder_blocks:
            layout = f" ({self.encoder_blocks} of a request's for its encoder's cross-attention)"
        dtype = "" if self.dtype is None else f" ({str(self.dtype).removeprefix('torch.')})"
        return (
            f"KV cache{dtype}: {self.num_blocks} blocks x {self.block_size} tokens{layout}, "
            f"{self.bytes_per_block} bytes/block, {self.total_bytes / GiB:.2f} GiB; "
            f"max concurrency at {self.max_model_len} tokens: {self.max_concurrency:.2f}x"
        )


def bytes_per_block(
    config: ModelConfig, groups: tuple[KVCacheGroup, ...], dtype: torch.dtype, block_size: int
) -> int:
    per_layer_token = 2 * config.num_key_value_heads * config.head_dim * dtype.itemsize
    return layers_per_block(groups) * per_layer_token * block_size


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
    max_chunk: int | None = None,
    encoder_blocks: int = 0,
) -> KVCachePlan:
    """Blocks for a memory budget (or an explicit block count). Raises ValueError when not even one
    sequence of max_model_len tokens would fit, saying how much memory that needs.

    `max_chunk`: the most tokens one step computes for a request (the step's token budget;
    max_model_len when None), which the sliding groups hold next to their window.
    `encoder_blocks`: an encoder-decoder's cross-attention blocks per request."""
    groups = config.kv_cache_groups()
    per_block = bytes_per_block(config, groups, dtype, block_size)
    if num_blocks is None:
        budget = default_cpu_kv_memory() if memory_bytes is None else memory_bytes
        num_blocks = budget // per_block
    plan = KVCachePlan(
        num_blocks,
        block_size,
        per_block,
        max_model_len,
        groups,
        max_chunk or max_model_len,
        dtype,
        encoder_blocks,
    )
    # The scheduler relies on this: a request of max_model_len tokens must fit on its own, or it
    # could preempt everyone, itself included, and never finish.
    if num_blocks < plan.blocks_per_seq:
        need = plan.blocks_per_seq * per_block
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
    tensor_parallel_size: int = 1,
) -> str:
    """What `pagedserve kv-plan` prints: the bytes one token takes, worked out step by step, and
    the memory and blocks that num_seqs sequences of max_model_len tokens need; for a model with
    sliding-window layers, also what they hold with their windows (decode steps: a window plus
    one token), layer by layer and as the engine's groups allocate it; with tensor parallelism,
    each rank's share (its KV heads)."""
    L, H, D = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    s = dtype.itemsize
    per_token = config.kv_bytes_per_token(s)
    per_layer = per_token // L
    B, T = num_seqs, max_model_len
    blocks_per_seq = cdiv(T, block_size)
    # Every sequence's last block is partly empty; the formula counts tokens, not blocks.
    total = B * T * per_token
    lines = [
        f"model: {name} ({config.architecture}), {L} layers, {H} KV heads, head_dim {D}, "
        f"dtype {str(dtype).removeprefix('torch.')} ({s} bytes)",
        f"per layer per token: 2 x {H} x {D} x {s} = {per_layer} bytes (K and V)",
        f"per token: {L} layers x {per_layer} = {per_token} bytes ({per_token / 1024:.1f} KiB)",
        f"total for {B} sequences x {T} tokens: M = 2*B*L*T*H_kv*D*s = "
        f"2*{B}*{L}*{T}*{H}*{D}*{s} = {total} bytes ({total / GiB:.3f} GiB)",
        f"blocks: {blocks_per_seq} per sequence of block_size {block_size}, "
        f"{B * blocks_per_seq} in all ({B * blocks_per_seq * block_size * per_token} bytes)",
    ]
    windows = [config.layer_window(i) for i in range(L)]
    if any(w is not None for w in windows):
        # Layer by layer: what each layer holds of one sequence, in blocks.
        held = [blocks_per_request((w,), T, block_size, 1) for w in windows]
        by_layer = B * sum(held) * block_size * per_layer
        num_sliding = sum(w is not None for w in windows)
        sliding_held = max(h for h, w in zip(held, windows, strict=True) if w is not None)
        lines.append(
            f"with windows: {num_sliding} of {L} layers slide over {config.sliding_window} "
            f"tokens and hold {sliding_held} blocks per sequence, the other {L - num_sliding} "
            f"hold {blocks_per_seq}: {by_layer} bytes ({by_layer / GiB:.3f} GiB, "
            f"{total / by_layer:.2f}x less than without)"
        )
        groups = config.kv_cache_groups()
        group_blocks = blocks_per_request([g.window for g in groups], T, block_size, 1)
        engine_bytes = B * group_blocks * bytes_per_block(config, groups, dtype, block_size)
        kinds = ", ".join(
            f"{'full' if g.window is None else 'sliding'} ({len(g.layers)} layers)" for g in groups
        )
        lines.append(
            f"as the engine allocates it: {len(groups)} groups of {layers_per_block(groups)} "
            f"layers [{kinds}], {group_blocks} blocks per sequence, {B * group_blocks} in all: "
            f"{engine_bytes} bytes ({engine_bytes / GiB:.3f} GiB)"
        )
    if config.is_encoder_decoder:
        lines += _encoder_lines(config.whisper.max_source_positions, per_token, B, T, block_size)
    if tensor_parallel_size > 1:
        lines += _tensor_parallel_lines(config, tensor_parallel_size, B * T, s)
    return "\n".join(lines)


def _encoder_lines(positions: int, per_token: int, B: int, T: int, block_size: int) -> list[str]:
    """An encoder-decoder's cross-attention KV: each decoder layer's K and V of every encoder
    position, written once at a request's admission into blocks of its own."""
    cross = positions * per_token
    blocks = cdiv(positions, block_size) + cdiv(T, block_size)
    total = B * (T * per_token + cross)
    return [
        f"cross-attention, per sequence ({positions} encoder positions, written once): "
        f"{positions} x {per_token} = {cross} bytes ({cross / 2**20:.1f} MiB), "
        f"{cdiv(positions, block_size)} blocks",
        f"with cross-attention: {total} bytes ({total / GiB:.3f} GiB), {B * blocks} blocks; "
        f"cross-attention is {cross / (T * per_token + cross):.0%} of it",
    ]


def _tensor_parallel_lines(
    config: ModelConfig, size: int, num_tokens: int, dtype_bytes: int
) -> list[str]:
    """Each rank's KV heads and bytes for `num_tokens` tokens; every rank's pool has as many
    blocks as the one with the most heads has room for."""
    # torch.distributed: only here
    from pagedserve.engine.models.parallel import describe_shards, plan_shards

    shards = plan_shards(config, size)
    lines = [describe_shards(config, shards)]
    for shard in shards:
        per_token = shard.local_config(config).kv_bytes_per_token(dtype_bytes)
        total = num_tokens * per_token
        lines.append(
            f"rank {shard.rank}: KV heads {shard.kv_heads[0]}..{shard.kv_heads[1] - 1} "
            f"({shard.num_kv_heads}): {per_token} bytes per token, {total} bytes "
            f"({total / GiB:.3f} GiB) for the workload"
        )
    return lines


def allocate_kv_caches(
    config: ModelConfig, plan: KVCachePlan, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer: the layer at position j of its group gets pair j, so the
    layers of different groups at one position share their tensors (scheduler/kv_groups.py)."""
    # Zeroed, not empty: attention reads whole blocks and masks the tail, and masked garbage that
    # happens to be NaN or inf would still poison the weighted sum.
    shape = (plan.num_blocks, plan.block_size, config.num_key_value_heads, config.head_dim)
    pairs = [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(layers_per_block(plan.groups))
    ]
    caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * config.num_hidden_layers
    for group in plan.groups:
        for position, layer in enumerate(group.layers):
            caches[layer] = pairs[position]
    return caches  # type: ignore[return-value]
