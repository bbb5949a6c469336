"""Decode steps replayed from CUDA graphs.

A decode step of a small model is dozens of short kernels per layer; launched one by one from
Python, the GPU waits on the CPU. A CUDA graph records the launches of one forward pass once and
replays them with a single call. A graph is fixed: same shapes, same tensor addresses. So:

    batch sizes   graphs are captured for a few sizes (1 2 4 8 16 32 48 ... max) and a batch of n
                  sequences runs in the smallest captured size >= n, padded
    buffers       the graphs read persistent input tensors (token ids, positions, slots, block
                  tables, lengths) that each step overwrites, and write one persistent output
    padding rows  slot -1 (their K/V is not written), sequence length 1 (they attend to one key
                  of a real block, harmless) and whatever ids and positions were there before

The block-table buffer is as wide as the longest sequence (max_model_len), so any decode step
fits. Prefill and mixed steps, and steps wider or larger than the largest graph, run eagerly.

`capture=False` keeps everything but the capture: steps go through the same buffers and padding
and run the model eagerly. CPU tests use it to check the padding, which a GPU run then replays.
"""

from __future__ import annotations

import logging
import time

import torch

from pagedserve.engine.models.attention_metadata import AttentionMetadata
from pagedserve.engine.models.model import CausalLM, KVCache
from pagedserve.engine.options import GiB

logger = logging.getLogger("pagedserve")

MAX_CAPTURE_BATCH_SIZE = 512


def capture_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch_size (which is always included).

    A batch of n runs padded to the next size: at most 15 wasted rows, and 36 graphs at 512
    (vLLM captures 1, 2, 4 and multiples of 8)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += range(16, max_batch_size, 16)
    return [*sizes, max_batch_size]


class DecodeGraphs:
    """Runs decode steps (one new token per sequence) through padded persistent buffers,
    replaying a captured CUDA graph per batch size when `capture` is set."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        max_batch_size: int,
        max_blocks_per_seq: int,
        device: torch.device,
        capture: bool = True,
        num_groups: int = 1,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = capture_batch_sizes(max_batch_size)
        self.max_batch_size = self.batch_sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.capture = capture
        n = self.max_batch_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        # Per KV-cache group, as AttentionMetadata holds them.
        self.slot_mapping = torch.full((num_groups, n), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(
            num_groups, n, max_blocks_per_seq, dtype=torch.int32, device=device
        )
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        # Sequence i is token i: fixed for every decode step.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def padded_size(self, num_seqs: int) -> int:
        """The captured batch size a step of `num_seqs` sequences runs in."""
        for size in self.batch_sizes:
            if size >= num_seqs:
                return size
        raise ValueError(f"{num_seqs} sequences exceed the largest graph ({self.max_batch_size})")

    def can_run(self, num_tokens: int, num_seqs: int, block_table_width: int) -> bool:
        return (
            num_tokens == num_seqs
            and num_seqs <= self.max_batch_size
            and block_table_width <= self.max_blocks_per_seq
        )

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture one graph per batch size, largest first, all sharing one memory pool (later,
        smaller graphs reuse the largest one's activation memory)."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        for size in reversed(self.batch_sizes):
            # Eager runs first: Triton compiles each kernel variant on its first launch, and
            # allocator warm-up must not happen inside the capture.
            for _ in range(2):
                self._forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "captured %d CUDA graphs for decode batches 1..%d in %.1f s, using %.2f GiB",
            len(self.graphs),
            self.max_batch_size,
            time.perf_counter() - start,
            used / GiB,
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode step of n sequences (inputs on the device)."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        width = meta.block_tables.shape[2]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:, :n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[:, n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n:size].fill_(1)
        # Columns past `width` keep older ids: they are valid blocks and past every seq_len.
        self.block_tables[:, :n, :width].copy_(meta.block_tables, non_blocking=True)
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        graph.replay()
        return self.outputs[size][:n]

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:, :size],
            block_tables=self.block_tables[:, :size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
        )
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
